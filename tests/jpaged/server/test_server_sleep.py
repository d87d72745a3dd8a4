"""The server's sleep-mode routes (vLLM's /sleep, /wake_up, /is_sleeping), with the real
`openai` client: a sleeping server answers 503 and the same tokens once awake."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import tiny
from serverkit import ENGINE_ARGS, MODEL, Served

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.server import BackgroundServer, build_app


def _post(url: str, path: str, **params) -> httpx.Response:
    return httpx.post(f"{url}{path}", params=params, timeout=60)


def test_sleep_wake_up_and_is_sleeping():
    engine = LLMEngine(EngineArgs(**ENGINE_ARGS, enable_sleep_mode=True), loaded=tiny())
    app = build_app(engine, MODEL)
    server = BackgroundServer(app)
    try:
        served = Served(app.state.engine, server.url)
        client, url = served.client(), server.url
        ask = dict(model=MODEL, prompt=[1, 5, 9, 23], max_tokens=6, temperature=0.0)
        want = client.completions.create(**ask).choices[0].text
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        assert _post(url, "/sleep", level=2).status_code == 400  # a caller's loaded model
        r = _post(url, "/sleep", level="abc")
        assert r.status_code == 400 and r.json()["error"]["param"] == "level", r.text
        assert _post(url, "/sleep", level=1).status_code == 200
        assert _post(url, "/sleep", level=1).status_code == 200  # asleep already: nothing done
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        states = {line.split('sleep_state="')[1].split('"')[0]: line.rsplit(" ", 1)[1]
                  for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                  if line.startswith("jpaged:engine_sleep_state{")}
        assert states == {"awake": "0.0", "weights_offloaded": "1.0", "discard_all": "0.0"}
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(**ask)
        assert e.value.status_code == 503 and "sleeping" in str(e.value)
        r = _post(url, "/wake_up", tags="nonsense")
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
        assert _post(url, "/wake_up", tags="weights").status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        assert _post(url, "/wake_up").status_code == 200
        assert client.completions.create(**ask).choices[0].text == want
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        server.stop()
        app.state.engine.shutdown()


def test_routes_are_absent_without_sleep_mode(served):
    assert httpx.post(f"{served.url}/sleep", timeout=30).status_code == 404

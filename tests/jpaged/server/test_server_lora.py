"""LoRA adapters served by name through a real uvicorn server and the official `openai` client:
vLLM's --lora-modules (the /v1/models cards, a request's `model` selecting an adapter), answers
checked token for token against HF transformers + peft, concurrent base and adapter requests,
the runtime /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints, and bad start-up input
(build_app and `jpaged serve`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import hf_greedy, hf_llama_twin, tiny
from lora_fixtures import peft_model, write_peft_adapter
from serverkit import ENGINE_ARGS, MODEL, Served

import jpaged.server.app as app_module
from jpaged.async_engine import AsyncLLMEngine
from jpaged.cli import normalize_argv
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.server import BackgroundServer, build_app
from jpaged.server.lora_modules import RUNTIME_UPDATING_ENV

LORA_ARGS = {**ENGINE_ARGS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
# The "chat" adapter's base_model_name: not a served name, so its card's parent is the served
# model (vLLM keeps a base_model_name only when it names a served model).
BASE_NAME = "tiny-base"
N = 12
# Greedy, EOS ignored (the references run without an EOS), the token ids in the answer.
GREEDY = dict(temperature=0, max_tokens=N,
              extra_body={"ignore_eos": True, "return_token_ids": True})
NO_EOS = (10**6,)  # an id no model emits: HF generate's EOS for the references
PROMPTS = ("The paged KV cache", "LoRA adapters, by name:")


@dataclass
class Adapters:
    """The PEFT adapter directories written once for the module, and their HF references."""

    hf: Any  # the HF transformers twin of tiny()
    dirs: dict[str, Path]
    _models: dict[str, Any] = field(default_factory=dict)
    _refs: dict[tuple[str | None, tuple[int, ...]], list[int]] = field(default_factory=dict)

    def ref(self, adapter: str | None, ids: list[int]) -> list[int]:
        """HF's greedy N tokens after `ids` (+ peft with `adapter`'s directory; None: base)."""
        key = (adapter, tuple(ids))
        if key not in self._refs:
            if adapter is None:
                self._refs[key] = hf_greedy(self.hf, list(ids), N, NO_EOS)
            else:
                if adapter not in self._models:
                    self._models[adapter] = peft_model(self.hf, self.dirs[adapter])
                self._refs[key] = hf_greedy(self._models[adapter], list(ids), N, NO_EOS)
        return self._refs[key]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Adapters:
    root = tmp_path_factory.mktemp("lora")
    hf = hf_llama_twin(tiny(), root / "hf")
    dirs = {name: write_peft_adapter(hf, root / name, r=r, alpha=2 * r, seed=seed)
            for name, r, seed in (("sql", 8, 1), ("chat", 4, 2), ("extra", 8, 3),
                                  ("too-big", 16, 4))}
    (root / "empty").mkdir()
    dirs["empty"] = root / "empty"
    dirs["missing"] = root / "no-such-adapter"
    return Adapters(hf, dirs)


@pytest.fixture(scope="module")
def lora_served(adapters) -> Iterator[Served]:
    """A server over a LoRA engine started with two adapters, runtime updating allowed:
    "sql" (name=path) and "chat" (JSON, with a base_model_name)."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**LORA_ARGS), loaded=tiny()))
    server = None
    try:
        app = build_app(engine, MODEL, lora_modules=[
            f"sql={adapters.dirs['sql']}",
            json.dumps({"name": "chat", "path": str(adapters.dirs["chat"]),
                        "base_model_name": BASE_NAME})], allow_runtime_lora_updating=True)
        server = BackgroundServer(app)
        yield Served(engine, server.url)
    finally:
        if server is not None:
            server.stop()
        engine.shutdown()


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _ids(served: Served, text: str) -> list[int]:
    return served.engine.tokenizer.encode(text)


def _cards(client: openai.OpenAI) -> list[dict[str, Any]]:
    return [m.to_dict() for m in client.models.list()]


def test_models_list_shows_the_base_model_then_each_adapter(lora_served, adapters):
    client = lora_served.client()
    cards = _cards(client)
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    base, sql, chat = cards
    assert base["root"] == lora_served.engine.model_source and base["parent"] is None
    assert sql["root"] == str(adapters.dirs["sql"]) and sql["parent"] == MODEL
    assert chat["root"] == str(adapters.dirs["chat"]) and chat["parent"] == MODEL
    assert all(c["object"] == "model" and c["max_model_len"] == ENGINE_ARGS["max_model_len"]
               for c in cards)
    got = client.models.retrieve("sql").to_dict()
    assert got["id"] == "sql" and got["root"] == str(adapters.dirs["sql"])
    assert got["parent"] == MODEL
    assert client.models.retrieve("chat").to_dict()["parent"] == MODEL
    assert client.models.retrieve(MODEL).to_dict()["parent"] is None
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-adapter")
    assert e.value.body["code"] == "model_not_found"


def test_completion_with_an_adapter_matches_peft_and_streams_the_same(lora_served, adapters):
    client = lora_served.client()
    ids = _ids(lora_served, PROMPTS[0])
    base = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert base.model == MODEL
    assert base.choices[0].token_ids == adapters.ref(None, ids)
    for name in ("sql", "chat"):
        out = client.completions.create(model=name, prompt=ids, **GREEDY)
        assert out.model == name  # the adapter's name, not its base_model_name
        choice = out.choices[0]
        assert choice.finish_reason == "length" and choice.prompt_token_ids == ids
        assert choice.token_ids == adapters.ref(name, ids), name
        assert choice.token_ids != base.choices[0].token_ids, name
        assert out.usage.completion_tokens == N

        chunks = list(client.completions.create(model=name, prompt=ids, stream=True, **GREEDY))
        assert chunks and all(c.model == name for c in chunks)
        body = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in body) == choice.text
        assert [t for c in body for t in c.choices[0].token_ids] == choice.token_ids
        assert body[-1].choices[0].finish_reason == "length"
    # A text prompt runs the same tokens as its ids.
    text = client.completions.create(model="sql", prompt=PROMPTS[0], **GREEDY)
    assert text.choices[0].token_ids == adapters.ref("sql", ids)


def test_chat_with_an_adapter_matches_peft_and_streams_the_same(lora_served, adapters):
    client, tok = lora_served.client(), lora_served.engine.tokenizer
    assert tok.has_chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                     add_special_tokens=False)
    base = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    full = client.chat.completions.create(model="sql", messages=msgs, **GREEDY)
    assert full.model == "sql" and full.prompt_token_ids == ids
    assert full.choices[0].token_ids == adapters.ref("sql", ids)
    assert full.choices[0].token_ids != base.choices[0].token_ids
    assert base.choices[0].token_ids == adapters.ref(None, ids)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model="sql", messages=msgs, stream=True,
                                                 **GREEDY))
    assert chunks and all(c.model == "sql" for c in chunks)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == msg.content
    assert [t for c in body for t in (getattr(c.choices[0], "token_ids", None) or [])] \
        == full.choices[0].token_ids
    assert body[-1].choices[0].finish_reason == "length"
    # The Responses API selects the adapter the same way (instructions: the system message).
    resp = client.responses.create(model="sql", input="Hi!", instructions="Be brief.",
                                   temperature=0, max_output_tokens=N,
                                   extra_body={"ignore_eos": True})
    assert resp.model == "sql" and resp.output_text == msg.content


async def _answer(client: openai.AsyncOpenAI, model: str, ids: list[int], stream: bool
                  ) -> tuple[set[str], list[int]]:
    """(the `model` fields seen, the token ids) of one completion, streamed or whole."""
    if not stream:
        out = await client.completions.create(model=model, prompt=ids, **GREEDY)
        return {out.model}, out.choices[0].token_ids
    chunks = [c async for c in await client.completions.create(
        model=model, prompt=ids, stream=True, **GREEDY)]
    return ({c.model for c in chunks},
            [t for c in chunks if c.choices for t in c.choices[0].token_ids])


def _run_together(served: Served, jobs: list[tuple[str, list[int], bool]]
                  ) -> list[tuple[set[str], list[int]]]:
    async def run() -> list:
        client = served.async_client()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(_answer(client, *job) for job in jobs)), timeout=300)
        finally:
            await client.close()

    return asyncio.run(run())


def test_concurrent_base_and_adapter_requests_answer_as_alone(lora_served, adapters):
    client = lora_served.client()
    prompts = [_ids(lora_served, p) for p in PROMPTS]
    models = (MODEL, "sql", "chat")
    alone = {(m, i): client.completions.create(model=m, prompt=ids, **GREEDY
                                               ).choices[0].token_ids
             for m in models for i, ids in enumerate(prompts)}
    for (m, i), got in alone.items():
        assert got == adapters.ref(None if m == MODEL else m, prompts[i]), (m, i)
    assert len({tuple(v) for v in alone.values()}) == len(alone)  # every answer its own
    jobs = [(m, i, stream) for m in models for i in range(len(prompts))
            for stream in (False, True)]
    results = _run_together(lora_served, [(m, prompts[i], s) for m, i, s in jobs])
    for (m, i, s), (seen, got) in zip(jobs, results, strict=True):
        assert seen == {m}, (m, i, s)
        assert got == alone[(m, i)], (m, i, s)
    m = lora_served.wait_drained(timeout=60)
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


def test_runtime_load_and_unload(lora_served, adapters):
    url, client = lora_served.url, lora_served.client()
    ids = _ids(lora_served, PROMPTS[1])
    extra = str(adapters.dirs["extra"])
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert r.status_code == 200 and "extra" in r.text, r.text
    cards = {c["id"]: c for c in _cards(client)}
    assert list(cards) == [MODEL, "sql", "chat", "extra"]
    assert cards["extra"]["root"] == extra and cards["extra"]["parent"] == MODEL
    out = client.completions.create(model="extra", prompt=ids, **GREEDY)
    assert out.model == "extra" and out.choices[0].token_ids == adapters.ref("extra", ids)

    # Three adapters at once on an engine with max_loras=2 (and the base model): each as alone.
    jobs = [(m, ids, False) for m in ("sql", "chat", "extra", MODEL)] * 2
    for (m, _, _), (seen, got) in zip(jobs, _run_together(lora_served, jobs), strict=True):
        assert seen == {m} and got == adapters.ref(None if m == MODEL else m, ids), m

    # Refusals: 400s (404 for a directory or file not there, as vLLM) naming the problem,
    # nothing listed, the server goes on.
    for body, param, words in (
            ({"lora_name": "extra", "lora_path": extra}, "lora_name", "already been loaded"),
            ({"lora_name": MODEL, "lora_path": extra}, "lora_name", "already been loaded"),
            ({"lora_name": "ghost", "lora_path": str(adapters.dirs["missing"])}, "lora_path",
             str(adapters.dirs["missing"])),
            ({"lora_name": "ghost", "lora_path": str(adapters.dirs["empty"])}, "lora_path",
             "adapter_config.json"),
            ({"lora_name": "ghost", "lora_path": str(adapters.dirs["too-big"])}, "lora_path",
             "max_lora_rank"),
            ({"lora_name": "ghost"}, "lora_path", "lora_path")):
        r = _post(url, "/v1/load_lora_adapter", body)
        gone = body.get("lora_path") in (str(adapters.dirs["missing"]),
                                         str(adapters.dirs["empty"]))
        assert r.status_code == (404 if gone else 400), (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
    assert [c["id"] for c in _cards(client)] == [MODEL, "sql", "chat", "extra"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ghost", prompt=ids, max_tokens=2)
    assert client.completions.create(model=MODEL, prompt=ids, **GREEDY
                                     ).choices[0].token_ids == adapters.ref(None, ids)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    # A name whose loads failed is free: loading it from a good directory works.
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": extra})
    assert r.status_code == 200, r.text
    out = client.completions.create(model="ghost", prompt=ids, **GREEDY)
    assert out.model == "ghost" and out.choices[0].token_ids == adapters.ref("extra", ids)

    for name in ("extra", "ghost"):
        r = _post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status_code == 200 and name in r.text, r.text
    assert [c["id"] for c in _cards(client)] == [MODEL, "sql", "chat"]
    for call in (lambda: client.completions.create(model="extra", prompt=ids, max_tokens=2),
                 lambda: client.chat.completions.create(
                     model="extra", messages=[{"role": "user", "content": "x"}], max_tokens=2),
                 lambda: client.models.retrieve("extra")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "model"
    for name in ("extra", "never-loaded"):
        r = _post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "lora_name"
    # Unloaded, the name may be loaded again from the same directory.
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert r.status_code == 200, r.text
    out = client.completions.create(model="extra", prompt=ids, **GREEDY)
    assert out.choices[0].token_ids == adapters.ref("extra", ids)
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    assert lora_served.engine.is_running


def _runtime_routes(engine: AsyncLLMEngine, adapters: Adapters, allow: bool | None,
                    name: str) -> tuple[int, int, list[str]]:
    """On a second app over `engine` (it does not own the engine), started with "sql":
    the status of loading `name`, of unloading it, and the model ids listed in between."""
    server = BackgroundServer(build_app(engine, MODEL, allow_runtime_lora_updating=allow,
                                        lora_modules=[f"sql={adapters.dirs['sql']}"]))
    try:
        loaded = _post(server.url, "/v1/load_lora_adapter",
                       {"lora_name": name, "lora_path": str(adapters.dirs["extra"])})
        listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models",
                                             timeout=30).json()["data"]]
        unloaded = _post(server.url, "/v1/unload_lora_adapter", {"lora_name": name})
        # "sql" is served either way.
        r = _post(server.url, "/v1/completions", {"model": "sql", "prompt": "x",
                                                  "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        return loaded.status_code, unloaded.status_code, listed
    finally:
        server.stop()


def test_runtime_updating_is_off_unless_allowed(lora_served, adapters, monkeypatch):
    engine = lora_served.engine
    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)
    assert _runtime_routes(engine, adapters, False, "off") == (404, 404, [MODEL, "sql"])
    assert _runtime_routes(engine, adapters, None, "unset") == (404, 404, [MODEL, "sql"])
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    assert _runtime_routes(engine, adapters, None, "by-env") == (200, 200,
                                                                  [MODEL, "sql", "by-env"])
    assert _runtime_routes(engine, adapters, False, "flag-wins") == (404, 404, [MODEL, "sql"])
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "0")
    assert _runtime_routes(engine, adapters, None, "env-0") == (404, 404, [MODEL, "sql"])
    assert engine.is_running  # the second apps neither own nor stop the shared engine


def test_build_app_refuses_bad_lora_modules_before_starting_the_engine(adapters):
    """Each refusal is a ValueError naming the entry or module, raised before the engine loop
    starts (an AsyncLLMEngine given unstarted stays so)."""
    d = adapters.dirs
    plain = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=tiny()), start=False)
    lora = AsyncLLMEngine(LLMEngine(EngineArgs(**LORA_ARGS), loaded=tiny()), start=False)
    try:
        for engine, modules, words in (
                (plain, ["nonsense"], ["'nonsense'", "name=path"]),
                (lora, ["nonsense"], ["'nonsense'", "name=path"]),
                (lora, ["=/a/path"], ["non-empty"]),
                (lora, ["{not json"], ["{not json", "not JSON"]),
                (lora, ['{"name": "x"}'], ["path"]),
                (lora, ['{"name": "x", "path": "/p", "rank": 8}'], ["rank"]),
                (lora, [f"a={d['sql']}", f"a={d['chat']}"], ["'a' twice"]),
                (plain, [f"sql={d['sql']}"], ["--lora-modules sql", "--enable-lora"]),
                (lora, [f"sql={d['sql']}", f"nothing={d['empty']}"],
                 ["--lora-modules nothing", "adapter_config.json"]),
                (lora, [f"gone={d['missing']}"], ["--lora-modules gone", str(d["missing"])]),
                (lora, [f"big={d['too-big']}"], ["--lora-modules big", "max_lora_rank"])):
            with pytest.raises(ValueError) as e:
                build_app(engine, MODEL, lora_modules=modules)
            for w in words:
                assert w in str(e.value), (modules, str(e.value))
            assert not engine.is_running and engine._thread is None, modules
    finally:
        plain.shutdown()
        lora.shutdown()


def test_build_app_over_an_llm_engine_leaves_no_loop_running_when_refused(adapters,
                                                                          monkeypatch):
    """The LoRA checks run before the engine loop starts (a refusal leaves nothing running)."""
    made: list[AsyncLLMEngine] = []

    class Recorded(AsyncLLMEngine):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(app_module, "AsyncLLMEngine", Recorded)
    engine = LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=tiny())  # no enable_lora
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            build_app(engine, MODEL, lora_modules=[f"sql={adapters.dirs['sql']}"])
        assert not any(a.is_running for a in made)
    finally:
        for a in made:
            a.shutdown()
        if not made:
            engine.shutdown()


def test_build_app_refuses_an_adapter_named_as_the_served_model(adapters):
    """As the load endpoint does: else requests naming the base model would get the adapter."""
    lora = AsyncLLMEngine(LLMEngine(EngineArgs(**LORA_ARGS), loaded=tiny()), start=False)
    try:
        with pytest.raises(ValueError, match=MODEL):
            build_app(lora, MODEL, lora_modules=[f"{MODEL}={adapters.dirs['sql']}"])
    finally:
        lora.shutdown()


def test_serve_cli_refuses_bad_lora_modules_before_loading_a_model():
    """`jpaged serve` checks --lora-modules first (exit 2 naming the flag); cli_capture's
    fakes stop any engine the command would build, so a model load would show as a target."""
    cli_dir = str(Path(__file__).resolve().parents[1])  # tests/jpaged, where cli_capture is
    if cli_dir not in sys.path:  # on the path already when tests/jpaged's own files ran
        sys.path.append(cli_dir)
    from cli_capture import capture

    for argv in (["serve", "--lora-modules", "nonsense"],
                 ["serve", "--lora-modules", "a=/x", "nonsense"],  # vLLM's list: both checked
                 ["serve", "--lora-modules", '{"name": "a"}'],
                 ["serve", "--lora-modules", "a=/x", "a=/y"]):
        r = capture(normalize_argv(argv))
        assert r.get("exit_code") == 2, (argv, r)
        assert "--lora-modules" in r["output"] and "Traceback" not in r["output"], r
    assert "nonsense" in capture(["serve", "--lora-modules", "nonsense"])["output"]
    assert "twice" in capture(normalize_argv(["serve", "--lora-modules", "a=/x", "a=/y"]))[
        "output"]
    # Good entries pass the check: the command goes on to build its (LoRA) engine.
    r = capture(normalize_argv(["serve", "--enable-lora", "--max-loras", "2", "--lora-modules",
                                "a=/x", '{"name": "b", "path": "/y"}']))
    assert r.get("target") == "create_engine", r
    assert r["args"]["enable_lora"] is True and r["args"]["max_loras"] == 2
    # Without --enable-lora: refused before any engine is built.
    r = capture(normalize_argv(["serve", "--lora-modules", "a=/x"]))
    assert r.get("exit_code") == 2 and "needs --enable-lora" in r["output"], r


def test_load_inplace_reads_the_adapter_anew(lora_served, adapters):
    """vLLM's load_inplace: an adapter loaded again under its name, here from another
    directory; the answers follow the new weights, and it can be unloaded as any other."""
    url, client = lora_served.url, lora_served.client()
    ids = _ids(lora_served, PROMPTS[0])
    body = {"lora_name": "swap", "lora_path": str(adapters.dirs["extra"])}
    assert _post(url, "/v1/load_lora_adapter", body).status_code == 200
    out = client.completions.create(model="swap", prompt=ids, **GREEDY)
    assert out.choices[0].token_ids == adapters.ref("extra", ids)
    assert _post(url, "/v1/load_lora_adapter", body).status_code == 400  # not in place
    body = {"lora_name": "swap", "lora_path": str(adapters.dirs["chat"]), "load_inplace": True}
    assert _post(url, "/v1/load_lora_adapter", body).status_code == 200
    out = client.completions.create(model="swap", prompt=ids, **GREEDY)
    assert out.choices[0].token_ids == adapters.ref("chat", ids)
    assert {c["id"]: c["root"] for c in _cards(client)}["swap"] == str(adapters.dirs["chat"])
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200

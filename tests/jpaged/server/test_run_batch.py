"""vLLM's run-batch: an OpenAI batch file answered by the server's own handlers in process,
every line in flight at once, answers in input order; a bad line is answered with its error
(vLLM's shape: body null, the error in `error`) and the others still run; lines that are no
request fail the run afterwards. Through `run_batch_lines` and as a user runs
`jpaged run-batch`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from helpers import tiny_model_dir
from serverkit import MODEL, Served

from jpaged.server import build_app
from jpaged.server.run_batch import run_batch_lines

GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_lines_answer_as_the_server_does_and_bad_ones_say_why(served: Served):
    import asyncio

    chat = {**GREEDY, "messages": [{"role": "user", "content": "hi there"}]}
    comp = {**GREEDY, "prompt": "Once upon", "n": 2, "temperature": 1.0, "seed": 3}
    lines = [_line("chat", "/v1/chat/completions", chat), "",
             _line("comp", "/v1/completions", comp),
             _line("emb", "/v1/images/generations", {"prompt": "x"}),
             "{not json", json.dumps(["a list"]),
             _line("stream", "/v1/completions", {**comp, "stream": True}),
             _line("bad", "/v1/completions", {**comp, "max_tokens": -1}),
             _line("who", "/v1/completions", {**comp, "model": "other"}),
             _line("resp", "/v1/responses", {"model": MODEL, "input": "hi there",
                                              "max_output_tokens": 6, "temperature": 0}),
             _line("bg", "/v1/responses", {"model": MODEL, "input": "x", "background": True})]
    result = asyncio.run(run_batch_lines(build_app(served.engine, MODEL), lines))
    out = result.lines
    assert result.malformed == [4, 5, 6]  # the url, not JSON, not an object
    assert [o["custom_id"] for o in out] == ["chat", "comp", "emb", None, None, "stream",
                                             "bad", "who", "resp", "bg"]  # no blank line
    assert [o["response"]["status_code"] for o in out] == [200, 200, 400, 400, 400, 400, 400,
                                                           404, 200, 400]
    resp, bg = out.pop(8)["response"]["body"], out.pop(8)
    assert resp["object"] == "response" and resp["usage"]["output_tokens"] == 6
    assert resp["output"][0]["type"] == "message"
    assert "background" in bg["error"]["message"] and bg["response"]["body"] is None
    # The answers are the server's for the same bodies (greedy, and seeded sampling).
    for o, (url, body) in zip(out[:2], (("/v1/chat/completions", chat),
                                         ("/v1/completions", comp)), strict=True):
        assert o["error"] is None and o["id"].startswith("jpaged-")
        want = httpx.post(f"{served.url}{url}", json=body, timeout=60).json()
        got = o["response"]["body"]
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert all(o["response"]["body"] is None for o in out[2:])
    messages = [o["error"]["message"] for o in out[2:]]
    assert "line 4: url '/v1/images/generations' is not served here" in messages[0]
    assert "line 5: not JSON" in messages[1] and "line 6: must be a JSON object" in messages[2]
    assert "must not stream" in messages[3] and "max_tokens" in messages[4]
    assert "`other` does not exist" in messages[5]
    assert out[6]["error"]["param"] == "max_tokens"


def test_jpaged_run_batch_writes_the_answers_in_order(tmp_path):
    """As a user runs it: the tiny model, a file in, a file out (a line with another url
    fails the run, after the others are answered); a missing input fails with its name
    before any model loads."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        _line(f"r{i}", "/v1/completions", {"model": "tiny", "prompt": f"prompt {i}",
                                          "max_tokens": 4, "temperature": 0})
        for i in range(5)] + [_line("x", "/v1/files", {})]) + "\n")
    dst = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "jpaged.cli", "run-batch", "-i", str(src), "-o", str(dst),
           "--model", str(tiny_model_dir()), "--served-model-name", "tiny",
           "--max-model-len", "64", "--num-gpu-blocks-override", "32"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "6 requests: 5 answered, 1 failed" in r.stderr
    assert "line(s) 6 are no batch requests" in r.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(5)] + ["x"]
    assert all(len(o["response"]["body"]["choices"][0]["text"]) > 0 for o in out[:5])
    assert out[5]["response"]["status_code"] == 400
    missing = subprocess.run([*cmd[:5], str(tmp_path / "nope.jsonl"), *cmd[6:]],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--input-file" in missing.stderr
    assert "nope.jsonl" in missing.stderr

"""vLLM's --generation-config: a model's generation_config.json sampling defaults (temperature,
top_p, top_k, min_p, repetition_penalty) fill what a request leaves unset, offline
(`LLM.generate` without sampling_params, `get_default_sampling_params`) and on the server;
its max_new_tokens is the default max_tokens and caps a server request's; "vllm" keeps
SamplingParams' own; a jpaged checkpoint keeps them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from helpers import tiny_model_dir

from jpaged import LLM, SamplingParams
from models.loader import load_model, sampling_defaults

KW = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
          num_gpu_blocks_override=16, block_size=8)
DEFAULTS = {"temperature": 0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.1}
MAX_NEW = 7  # the file's max_new_tokens: SamplingParams' max_tokens
READ = {**DEFAULTS, "max_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with a generation_config.json asking for greedy decoding and at most 7
    new tokens (do_sample is not a sampling default)."""
    path = tmp_path_factory.mktemp("gen") / "tiny"
    shutil.copytree(tiny_model_dir(), path)
    (path / "generation_config.json").write_text(json.dumps(
        {**DEFAULTS, "max_new_tokens": MAX_NEW, "do_sample": False}))
    return path


def test_the_model_defaults_are_read_and_bad_ones_named(model_dir, tmp_path):
    assert sampling_defaults(model_dir) == READ
    assert sampling_defaults(tmp_path) == {}  # no file: none
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="invalid JSON"):
        sampling_defaults(tmp_path)
    for bad in (0, 2.5):
        (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
            sampling_defaults(tmp_path)


def test_offline_defaults_and_vllm_mode(model_dir):
    llm = LLM(model=str(model_dir), **KW)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty) == (0.0, 5, 0.9, 1.1)
    assert d.max_tokens == MAX_NEW
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.9, repetition_penalty=1.1,
                            max_tokens=16, ignore_eos=True)
    want = llm.generate(["abc", "hello"], greedy)
    got = [llm.generate(p)[0] for p in ("abc", "hello")]  # no sampling_params: the defaults
    for w, g in zip(want, got, strict=True):
        out = g.outputs[0]
        assert out.token_ids == w.outputs[0].token_ids[:len(out.token_ids)]
        assert len(out.token_ids) == MAX_NEW or out.finish_reason == "stop"
    plain = LLM(model=str(model_dir), generation_config="vllm", **KW)
    assert plain.get_default_sampling_params().temperature == 1.0
    assert plain.get_default_sampling_params().max_tokens == 16  # SamplingParams' own
    elsewhere = LLM(model=str(tiny_model_dir()), generation_config=str(model_dir), **KW)
    assert elsewhere.get_default_sampling_params().top_k == 5
    with pytest.raises(ValueError, match="generation_config"):
        LLM(model=str(model_dir), generation_config="/no/such/dir", **KW)


def test_server_fills_unset_fields_from_the_defaults(model_dir):
    from jpaged.async_engine import AsyncLLMEngine
    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine
    from jpaged.server import BackgroundServer, build_app

    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model_dir), **KW)))
    server = BackgroundServer(build_app(engine, "tiny"))
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True}

    def ids(**extra):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def chat_tokens(**extra):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "abc"}],
            "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    try:
        # temperature unset: the model's 0 (greedy), so every run gives the same tokens; the
        # request's own temperature still wins (seeded draws that differ from greedy).
        assert ids() == ids() == ids(temperature=0)
        hot = {tuple(ids(temperature=2.0, top_k=-1, top_p=1.0, seed=s)) for s in range(4)}
        assert len(hot) > 1
        # max_new_tokens caps what a request asks (vLLM's min of the two) and is the
        # default of one that asks nothing.
        assert len(ids()) == MAX_NEW and len(ids(max_tokens=3)) == 3
        assert chat_tokens() == MAX_NEW and chat_tokens(max_completion_tokens=2) == 2
    finally:
        server.stop()
        engine.shutdown()


def test_a_checkpoint_keeps_the_defaults(model_dir, tmp_path):
    from models.checkpoint import load_checkpoint, save_checkpoint

    out = save_checkpoint(load_model(str(model_dir), dtype="float32"), tmp_path / "ckpt")
    assert load_checkpoint(out).generation_config == READ

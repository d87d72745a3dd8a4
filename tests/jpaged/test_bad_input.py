"""Bad input through the Python API and the CLI: a ValueError / FileNotFoundError (CLI: exit 2)
naming the field, flag or file, never a traceback; and the same engine goes on serving
correctly. The matrix is tests/bad_input_cases.py; the server side is in tests/jpaged/server."""

from __future__ import annotations

import numpy as np
import pytest
from bad_input_cases import (
    CONFIG_CASES,
    ENGINE_ARGS,
    GOOD_MAX_TOKENS,
    GOOD_PROMPT,
    REQUEST_CASES,
    ConfigCase,
    RequestCase,
    build_model_cases,
)
from helpers import make_llm, tiny, tiny_model_dir
from typer.testing import CliRunner

from jpaged import LLM, SamplingParams
from jpaged.cli import app
from jpaged.config import EngineArgs
from models.loader import embedded_gguf_path

GREEDY = SamplingParams(temperature=0, max_tokens=GOOD_MAX_TOKENS, ignore_eos=True)
# The CLI runs with the tiny model and the matrix's engine settings; `serve` gets a host it
# cannot bind, so a bad value that slipped through fails instead of serving forever.
CLI_ENGINE = ("--model", "{model}", "--max-model-len", "128", "--max-num-seqs", "16",
              "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "160")
SERVE_GUARD = ("--host", "256.0.0.1")


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One engine over the tiny model that every bad request is thrown at."""
    return make_llm(tiny(), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    """Greedy tokens of the good prompt, before any bad input."""
    return llm.generate(GOOD_PROMPT, GREEDY)[0].outputs[0].token_ids


def _still_serves(llm: LLM, reference: list[int]) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert llm.get_metrics()["kv_cache_usage"] == 0.0  # nothing half-queued holds blocks
    assert llm.generate(GOOD_PROMPT, GREEDY)[0].outputs[0].token_ids == reference


def _cli(*args: str, model: str | None = None) -> tuple[int, str]:
    """(exit code, stderr) of `jpaged ARGS` run in-process; asserts no traceback escaped."""
    model = model or str(tiny_model_dir())
    result = CliRunner().invoke(app, [a.replace("{model}", model) for a in args])
    out = result.stderr + result.stdout
    assert "Traceback" not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    return result.exit_code, result.stderr


# ------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("case", REQUEST_CASES, ids=lambda c: c.name)
def test_bad_request_through_the_api(llm: LLM, reference: list[int], case: RequestCase) -> None:
    engine = llm.llm_engine
    if case.is_sampling:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{case.field} must be"):
            SamplingParams(**case.sampling)
        # A SamplingParams changed after construction is validated again by the engine.
        params = SamplingParams(temperature=0, max_tokens=4)
        for k, v in case.sampling.items():
            setattr(params, k, v)
        with pytest.raises(ValueError, match=rf"SamplingParams\.{case.field}"):
            engine.add_request("bad", GOOD_PROMPT, params)
        with pytest.raises(ValueError, match=rf"SamplingParams\.{case.field}"):
            llm.generate([GOOD_PROMPT, "second"], [GREEDY, params])
    else:
        with pytest.raises(ValueError, match=case.field):
            engine.add_request("bad", case.prompt, GREEDY)
        # In a batch, the good prompt queued before it is withdrawn again.
        with pytest.raises(ValueError, match=case.field):
            llm.generate([GOOD_PROMPT, case.prompt], GREEDY)
    _still_serves(llm, reference)


@pytest.mark.parametrize("case", [c for c in REQUEST_CASES if c.cli is not None],
                         ids=lambda c: c.name)
def test_bad_request_through_the_cli(case: RequestCase) -> None:
    code, err = _cli("generate", *case.cli, *CLI_ENGINE)
    assert code == 2, err
    assert case.field in err
    if case.is_sampling:  # the flag as the user typed it
        assert f"--{case.field.replace('_', '-')}" in err


@pytest.mark.parametrize("bad", [
    lambda llm: llm.generate(5),
    lambda llm: llm.generate(GOOD_PROMPT, {"temperature": 0}),
    lambda llm: llm.generate({"prompt_token_ids": None}),
    lambda llm: llm.generate({"prompt_token_ids": "abc"}),
    lambda llm: llm.generate({"prompt_token_ids": [65, 66.0]}),
    lambda llm: llm.generate({"prompt": 7}),
    lambda llm: llm.generate([GOOD_PROMPT, None]),
    lambda llm: llm.generate(GOOD_PROMPT, GREEDY, priority=["high"]),
    lambda llm: SamplingParams(temperature="0.5"),
    lambda llm: SamplingParams(top_p=None),
    lambda llm: SamplingParams(n=True),
    lambda llm: SamplingParams(max_tokens=2.5),
    lambda llm: SamplingParams(stop=5),
    lambda llm: SamplingParams(stop_token_ids=[-1]),
    lambda llm: SamplingParams(logprobs="all"),
], ids=["prompts_int", "params_dict", "token_ids_none", "token_ids_str", "token_id_float",
        "prompt_int", "prompt_none", "priority_str", "temperature_str", "top_p_none", "n_bool",
        "max_tokens_float", "stop_int", "stop_token_negative", "logprobs_str"])
def test_wrong_types_through_the_api(llm: LLM, reference: list[int], bad) -> None:
    with pytest.raises(ValueError):  # never a TypeError/AttributeError from deeper down
        bad(llm)
    _still_serves(llm, reference)


def test_extreme_but_valid_values_leave_other_requests_alone(llm: LLM,
                                                             reference: list[int]) -> None:
    # top_k past the vocabulary once overflowed the int32 step batch and failed the whole
    # step, i.e. every request in flight with it. Greedy ignores top_k and seed.
    wild = GREEDY.clone(top_k=10**12, seed=2**63 - 1)
    outs = llm.generate(["other prompt", GOOD_PROMPT, GOOD_PROMPT], [GREEDY, wild, GREEDY])
    assert [o.outputs[0].token_ids for o in outs[1:]] == [reference, reference]
    ids = np.array(outs[1].prompt_token_ids, dtype=np.int64)  # numpy ids are fine too
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids == reference
    _still_serves(llm, reference)


# ------------------------------------------------------------------------------ engine config
@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.name)
def test_bad_engine_config(llm: LLM, reference: list[int], case: ConfigCase) -> None:
    with pytest.raises(ValueError, match=rf"\.{case.field} must be"):
        EngineArgs(**case.engine).create_engine_config(512)
    with pytest.raises(ValueError, match=rf"\.{case.field} must be"):
        LLM(str(tiny_model_dir()), **case.engine)
    if case.cli is not None:
        flag = case.cli[0]
        for command in (("generate", "hi"), ("serve", *SERVE_GUARD)):
            code, err = _cli(*command, *CLI_ENGINE, *case.cli)
            assert code == 2, (command, err)
            assert flag in err and case.field in err, err
    _still_serves(llm, reference)


@pytest.mark.parametrize("args,needle", [
    (("generate", "hi", "--max-tokens", "many"), "--max-tokens"),
    (("generate", "hi", "--temperature", "hot"), "--temperature"),
    (("serve", "--block-size", "x"), "--block-size"),
    (("serve", "--port", "http"), "--port"),
    # A value of the right type that no server can use, refused before anything starts.
    (("serve", "--data-parallel-size", "0", *SERVE_GUARD), "--data-parallel-size must be >= 1"),
])
def test_cli_flag_of_the_wrong_type(args: tuple[str, ...], needle: str) -> None:
    code, err = _cli(*args)
    assert code == 2 and needle in err


def test_cli_bad_input_files(tmp_path) -> None:
    cases = {"missing.jsonl": None, "not_json.jsonl": '{"prompt": "a"}\n{oops\n',
             "no_prompt.jsonl": '{"text": "a"}\n', "int_prompt.jsonl": '{"prompt": 5}\n',
             "empty_prompt.jsonl": '{"prompt": "a"}\n{"prompt": ""}\n',
             # JSON that is not an object, an unknown key, bytes that are not UTF-8, a folder
             "list.jsonl": '[1, 2, 3]\n', "null.jsonl": 'null\n',
             "extra_key.jsonl": '{"prompt": "a", "max_tokens": 3}\n', "latin1.jsonl": b"\xff\xfe\n",
             "folder.jsonl": ...}
    for name, text in cases.items():
        path = tmp_path / name
        if isinstance(text, str):
            path.write_text(text)
        elif isinstance(text, bytes):
            path.write_bytes(text)
        elif text is ...:
            path.mkdir()
        code, err = _cli("generate", "--input", str(path), *CLI_ENGINE)
        assert code == 2, (name, err)
        assert str(path) in err or "prompt 2" in err, (name, err)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n')
    # --output that cannot be written is refused before the model loads.
    for bad, needle in ((tmp_path, "is a directory"), (tmp_path / "nope" / "o.jsonl",
                                                       "no such directory")):
        code, err = _cli("generate", "--input", str(good), "--output", str(bad), *CLI_ENGINE)
        assert code == 2 and needle in err and "--output" in err, err


# ------------------------------------------------------------------------------ model files
@pytest.fixture(scope="module")
def model_cases(tmp_path_factory):
    """Missing paths, truncated safetensors/GGUF copies and bad config.json files."""
    return build_model_cases(tmp_path_factory.mktemp("bad_models"), tiny_model_dir(),
                             embedded_gguf_path())


def test_bad_model_files_through_the_api(model_cases, llm: LLM, reference: list[int]) -> None:
    for case in model_cases:
        with pytest.raises(case.error) as info:
            LLM(case.path, **ENGINE_ARGS)
        for needle in case.needles:
            assert needle in str(info.value), (case.name, str(info.value))
    _still_serves(llm, reference)


# `serve` reaches the loader the way `generate` does: one case of each kind is enough there.
SERVE_MODEL_CASES = {"missing_dir", "safetensors_truncated_half", "gguf_truncated_4096",
                     "unsupported_architecture"}


def test_bad_model_files_through_the_cli(model_cases) -> None:
    for case in model_cases:
        serve = (("serve", *SERVE_GUARD),) if case.name in SERVE_MODEL_CASES else ()
        for command in (("generate", "hi"), *serve):
            code, err = _cli(*command, *CLI_ENGINE, model=case.path)
            assert code == 2, (case.name, command, err)
            flat = " ".join(err.split())  # rich may wrap long paths
            assert all(n in flat or n in err for n in case.needles), (case.name, err)

"""The `jpaged` command line as a user runs it: a real subprocess, stdout and stderr apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import tiny_model_dir


def _jpaged(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jpaged.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_answers_paris_on_the_embedded_model():
    r = _jpaged("generate", "What is the capital of France?", "--temperature", "0",
                "--max-tokens", "24", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_json_and_jsonl_files(tmp_path):
    model = str(tiny_model_dir())
    r = _jpaged("generate", "abc", "hello there", "--model", model, "--json", "--raw",
                "--max-tokens", "4", "--temperature", "0", "--max-model-len", "128",
                "--kv-cache-memory-bytes", str(64 * 2**20))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["abc", "hello there"]
    assert all(set(x) == {"prompt", "text", "token_ids", "finish_reason"} for x in lines)
    assert all(len(x["token_ids"]) <= 4 for x in lines)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    dst = tmp_path / "out.jsonl"
    r = _jpaged("generate", "--input", str(src), "--output", str(dst), "--model", model,
                "--max-tokens", "3", "--max-model-len", "128",
                "--kv-cache-memory-bytes", str(64 * 2**20), "--no-async-scheduling")
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["prompt"] for x in dst.read_text().splitlines()] == ["one", "two"]


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nonexistent/model"], "not found"),
    (["generate", "hi", "--block-size", "12"], "block_size"),
    (["generate"], "PROMPT"),
    (["generate", "hi", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": 1}'],
     "--kv-events-config: kv_events_config.publisher must be one of"),
    (["generate", "hi", "--structured-outputs-config", '{"backend": "xgrammar"}'],
     "--structured-outputs-config: structured_outputs_config.backend must be one of"),
])
def test_bad_input_gives_clear_error(args, needle):
    r = _jpaged(*args)
    assert r.returncode != 0
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_help_lists_vllm_flags():
    r = subprocess.run([sys.executable, "-m", "jpaged.cli", "generate", "--help"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for flag in ("--gpu-memory-utilization", "--block-size", "--enable-prefix-caching",
                 "--kv-cache-dtype", "--swap-space", "--kv-offloading-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--tensor-parallel-size",
                 "--preemption-mode", "--async-scheduling", "--no-async-scheduling",
                 "--kv-events-config", "--dtype", "--kv-cache-dir", "--calculate-kv-scales",
                 "--prefix-caching-hash-algo", "--scheduling-policy",
                 "--structured-outputs-config"):
        assert flag in r.stdout


# Which engine flags each command takes (jpaged/cli_*.py): offline commands log no stats, tune
# runs in one process, estimate plans the pool's shape only.
_NOT_ON = {
    "generate": {"disable_log_stats"}, "chat": {"disable_log_stats"},
    "bench": {"disable_log_stats"}, "serve": set(),
    "tune": {"disable_log_stats", "swap_space", "nnodes", "node_rank", "master_addr",
             "master_port", "distributed_timeout_s", "engine_core_process"},
}
_ESTIMATE_FLAGS = {"block_size", "kv_cache_dtype", "max_model_len", "tensor_parallel_size",
                   "max_num_seqs"}


def _commands() -> dict:
    import typer

    from jpaged.cli import app

    return typer.main.get_command(app).commands


def test_every_engine_arg_is_a_flag_with_its_default_and_help():
    """Each EngineArgs field (but the two that code sets) is a flag of every engine command:
    its kebab-cased name, `--x/--no-x` for a boolean, the field's default, and as help its
    docstring, with the other fields it names written as flags."""
    import dataclasses
    import typing

    from jpaged.cli_engine_flags import CHOICES, NOT_FLAGS, SHORT_NAMES, field_docs
    from jpaged.config import EngineArgs

    assert NOT_FLAGS == {"data_parallel_rank", "extra"}
    docs = field_docs(EngineArgs)
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    types = typing.get_type_hints(EngineArgs)
    assert set(docs) == set(fields) and all(docs.values())  # every field documented
    commands = _commands()
    expected = {name: set(fields) - NOT_FLAGS - off for name, off in _NOT_ON.items()}
    expected["estimate"] = _ESTIMATE_FLAGS
    for name, flags in expected.items():
        params = {p.name: p for p in commands[name].params}
        for field in flags:
            p, f = params[field], fields[field]
            kebab = "--" + field.replace("_", "-")
            assert p.default == f.default and type(p.default) is type(f.default), (name, field)
            assert p.help and p.help.split()[:3] == docs[field].split()[:3], (name, field)
            if field in CHOICES:
                assert p.help.endswith(f"One of: {', '.join(CHOICES[field])}."), (name, field)
            if types[field] is bool:
                assert (p.opts, p.secondary_opts) == ([kebab], ["--no-" + kebab[2:]]), field
            else:
                short = SHORT_NAMES.get(field)  # vLLM's: -m, -tp, -q, -n, -r
                assert p.opts == [kebab, *([short] if short else [])], p.opts
    serve = {p.name: p for p in commands["serve"].params}
    assert serve["model"].opts == ["--model", "-m"]
    assert "--gpu-memory-utilization." in serve["kv_cache_memory_bytes"].help  # a field named
    assert "--max-model-len" in serve["max_num_batched_tokens"].help
    assert "the model's dtype" in serve["kv_cache_dtype"].help  # one-word names stay words


def test_flag_types_follow_the_field_types():
    """Optional fields take a value or stay unset; a config field takes its JSON text."""
    from jpaged.cli_engine_flags import ENGINE_FLAGS, _flag_type
    from jpaged.config import KVTransferConfig

    assert _flag_type("x", int | None) == (int, True)
    assert _flag_type("x", float) == (float, False)
    assert _flag_type("x", bool) == (bool, False)
    assert _flag_type("x", KVTransferConfig | dict | str | None) == (str, True)
    for bad in (list[int], dict, bool | None, int | float):
        with pytest.raises(TypeError, match="EngineArgs.x: no flag"):
            _flag_type("x", bad)
    kinds = {name: (f.value_type.__name__, f.optional) for name, f in ENGINE_FLAGS.items()}
    assert kinds["gpu_memory_utilization"] == ("float", True)
    assert kinds["max_model_len"] == ("int", True)
    assert kinds["enable_prefix_caching"] == ("bool", False)
    assert kinds["kv_events_config"] == kinds["kv_transfer_config"] == ("str", True)
    assert kinds["structured_outputs_config"] == ("str", True)


def test_with_engine_flags_refuses_unknown_and_doubled_flags():
    from jpaged.cli_engine_flags import with_engine_flags

    with pytest.raises(ValueError, match="not engine flags: \\['block_sise'\\]"):
        with_engine_flags(exclude=("block_sise",))
    with pytest.raises(ValueError, match="not engine flags: \\['extra'\\]"):
        with_engine_flags(only=("extra",))

    def command(block_size: int = 16, engine_flags: dict | None = None) -> None:
        """A command that declares an engine flag itself."""

    with pytest.raises(ValueError, match="declares engine flags itself: \\['block_size'\\]"):
        with_engine_flags()(command)


def test_field_docs_reads_attribute_docstrings():
    import dataclasses

    from jpaged.cli_engine_flags import field_docs

    @dataclasses.dataclass
    class Args:
        a: int = 1
        """First
        line two."""
        b: str = "x"  # a comment is no docstring
        c: float = 0.0
        """Third."""

    assert field_docs(Args) == {"a": "First\nline two.", "c": "Third."}


# The one command line whose EngineArgs changed on purpose: serve gives its workers (node
# rank > 0) --disable-log-stats as well now (it was serve's own flag, not an engine flag, so
# they got the default). A worker runs process 0's steps and never logs stats either way.
_KNOWN_CHANGES = {("serve", "--disable-log-stats", "--nnodes", "2", "--node-rank", "1"):
                  {"disable_log_stats": True}}
# Error messages changed since, on purpose: click's close-match hint for an unknown flag now
# also names --runner (a flag added since, vLLM's, spelled like --nnodes to difflib).
_KNOWN_BAD_CHANGES = {("tune", "--nnodes", "2"): {
    "exit_code": 2, "output": "Usage: root tune [OPTIONS]\nTry 'root tune --help' for help."
    "\n\nError: No such option: --nnodes (Possible options: --model, --runner)\n"}}
# Arguments added since that are no EngineArgs field (estimate's), with their defaults.
_NEW_ARGS = {"draft_model": None}


def _before() -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).parent / "cli_engine_args_before.json").read_text())


def test_command_lines_build_the_same_engine_args_as_before():
    """Every command line of tests/jpaged/cli_capture.py builds the EngineArgs (or estimate's
    arguments) the hand-declared flags built, recorded from that code (commit b2df20e)."""
    import dataclasses

    from cli_capture import GOOD, capture, typed

    from jpaged.config import EngineArgs

    before = _before()["good"]
    assert [argv for argv, _ in before] == GOOD
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)
                if f.default is not dataclasses.MISSING} | _NEW_ARGS
    for argv, old in before:
        new = capture(argv)
        assert new.get("target") == old["target"], (argv, new)
        expected = {**old["args"], **_KNOWN_CHANGES.get(tuple(argv), {})}
        got = new["args"]
        assert typed({k: got[k] for k in expected}) == typed(expected), argv
        for k in set(got) - set(expected):  # a field added since: its default
            assert typed(got[k]) == typed(defaults[k]), (argv, k)


def test_bad_values_stop_with_the_same_errors_as_before():
    """Bad values keep their exit status and message, which names the flag."""
    from cli_capture import BAD, capture

    before = _before()["bad"]
    assert [argv for argv, _ in before] == BAD
    for argv, old in before:
        old = _KNOWN_BAD_CHANGES.get(tuple(argv), old)
        assert capture(argv) == old, argv
        assert old["exit_code"] == 2 and "--" in old["output"]


def test_every_help_keeps_flags_and_choices_whole_at_80_columns():
    """On an 80-column terminal (or piped into less) no option name, and no name in a choice
    list, is cut: these are the vLLM flag names users look for."""
    import typer
    from typer.testing import CliRunner

    from jpaged.cli import app

    group = typer.main.get_command(app)
    runner = CliRunner()
    for name, command in group.commands.items():
        r = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert r.exit_code == 0, r.output
        assert "…" not in r.output, (name, r.output)
        words = set(r.output.replace(",", " ").replace(".", " ").split())
        for param in command.params:
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("-"):
                    assert opt in words, (name, opt)
        if name in ("generate", "serve"):
            assert {"fp8_e4m3", "fp8_e5m2", "recompute", "swap", "reference"} <= words


# ------------------------------------------------------------------ vLLM's command lines
def test_vllm_spellings_of_the_arguments_are_read():
    """vLLM's parser reads `--max_model_len` as `--max-model-len`, and a `--config` YAML's
    flags as if given right after the command, so the command line's own win."""
    from jpaged.cli import normalize_argv

    assert normalize_argv(["serve", "--max_model_len=4k", "--enforce_eager", "a_b", "--",
                           "--x_y"]) == ["serve", "--max-model-len=4k", "--enforce-eager",
                                         "a_b", "--", "--x_y"]
    # vLLM's several served names after one flag: the flag once per name.
    assert normalize_argv(["serve", "m", "--served_model_name", "a", "b", "--port", "1"]) == [
        "serve", "m", "--served-model-name", "a", "--served-model-name", "b", "--port", "1"]
    assert normalize_argv(["serve", "--served-model-name", "--port", "1"]) == [
        "serve", "--served-model-name", "--port", "1"]  # no name: the parser says so


def test_config_file_flags_and_their_errors(tmp_path):
    from jpaged.cli import normalize_argv

    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_model_len: 4k\nenable-prefix-caching: false\nenforce_eager: true\n"
                   "speculative_config: {method: suffix}\nport: 9000\nunset: null\n")
    got = normalize_argv(["serve", "--port", "8001", "--config", str(cfg)])
    assert got == ["serve", "--max-model-len", "4k", "--no-enable-prefix-caching",
                   "--enforce-eager", "--speculative-config", '{"method": "suffix"}',
                   "--port", "9000", "--port", "8001"]  # the command line's --port is last
    for text, match in (("- a\n- b\n", "must map flag names"), ("a: [b\n", "is not YAML")):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=match):
            normalize_argv(["serve", f"--config={cfg}"])
    with pytest.raises(ValueError, match="nope.yaml"):
        normalize_argv(["serve", "--config", str(tmp_path / "nope.yaml")])


def test_human_readable_integers_auto_and_dtype_spellings():
    from jpaged.cli_engine_flags import human_readable_int
    from jpaged.config import EngineArgs

    assert [human_readable_int(v) for v in ("1k", "1K", "25.6k", "4.35k", "2m", "1G", "77")] \
        == [1000, 1024, 25600, 4350, 2_000_000, 2**30, 77]
    assert human_readable_int("auto", auto=True) == -1
    for bad in ("1.5K", "k", "1kb", "auto"):
        with pytest.raises(ValueError, match=repr(bad)):
            human_readable_int(bad)
    assert EngineArgs(dtype="half").dtype == "float16"
    assert EngineArgs(dtype="float").dtype == "float32"
    cfg = EngineArgs(max_model_len=-1).create_engine_config(4096)
    assert cfg.scheduler.max_model_len == 4096  # vLLM's auto: the model's whole context


def test_vllm_command_lines_run(tmp_path):
    """As a user copies them from vLLM: the jpaged script with a --config file, underscores,
    a human-readable length and vLLM's dtype spelling (the file's length loses to the
    command line's); `serve MODEL` takes the model positionally, refusing two models."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_model_len: 2k\ndtype: half\nblock_size: 32\n")
    r = _jpaged("estimate", "--config", str(cfg), "--max_model_len", "1k")
    assert r.returncode == 0, r.stderr
    assert "blocks per 1000-token sequence" in r.stdout and "float16" in r.stdout
    assert "32" in r.stdout
    r = _jpaged("serve", "/no/such/model", "--port", "1")
    assert r.returncode != 0 and "/no/such/model" in r.stderr and "Traceback" not in r.stderr
    r = _jpaged("serve", str(tiny_model_dir()), "--model", "/other")
    assert r.returncode == 2 and "the model is given twice" in r.stderr
    r = _jpaged("serve", "--max-model-len", "1.5K")
    assert r.returncode == 2 and "no decimals with the binary suffix K" in r.stderr

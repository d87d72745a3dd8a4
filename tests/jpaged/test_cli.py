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


def test_every_engine_arg_has_a_flag():
    """`--help` promises every engine flag: each EngineArgs field is one, but for `model`
    (each command's own argument), `disable_log_stats` (serve's own flag) and two internals."""
    import dataclasses

    from jpaged.cli import ENGINE_FLAGS
    from jpaged.config import EngineArgs

    own = {"model", "disable_log_stats", "extra", "data_parallel_rank"}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert fields - set(ENGINE_FLAGS) - own == set()


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

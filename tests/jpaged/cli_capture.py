"""What a `jpaged` command line builds, without building it: the EngineArgs (or estimate's
arguments) each command would hand to the engine, or the error it stops with.

The engine constructors the commands call are replaced for the run by fakes that validate the
arguments as the real engine does (`create_engine_config`) and then stop the command with the
arguments they were given. The same cases run against any version of the CLI, so
`python tests/jpaged/cli_capture.py OUT.json` with PYTHONPATH at an older checkout records
what that version builds. tests/jpaged/cli_engine_args_before.json was made so from commit
b2df20e, whose CLI declared its engine flags by hand (before they were derived from
EngineArgs); tests/jpaged/test_cli.py compares today's CLI against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

# Every engine flag in every form a user writes it: defaults, each type, both spellings of
# the booleans, `--flag=value`, repeated flags (the last wins), negative numbers, JSON configs,
# and each command that builds an engine (generate, serve, chat, bench, tune, a worker rank,
# data-parallel serve) and estimate.
GOOD: list[list[str]] = [
    ["generate", "hi"],
    ["generate", "hi", "there", "-m", "/no/such/model", "--raw"],
    ["generate", "--model", "some/repo", "--max-num-seqs", "4", "hi"],
    ["generate", "hi", "--block-size", "32", "--gpu-memory-utilization", "0.5",
     "--kv-cache-memory-bytes", "1000000", "--num-gpu-blocks-override", "100"],
    ["generate", "hi", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
     "--no-async-scheduling", "--engine-core-process", "--calculate-kv-scales",
     "--disable-hybrid-kv-cache-manager", "--kv-cache-dtype", "fp8"],
    ["generate", "hi", "--enable-prefix-caching", "--enable-chunked-prefill",
     "--async-scheduling", "--no-engine-core-process"],
    ["generate", "hi", "--no-enable-prefix-caching", "--enable-prefix-caching",
     "--async-scheduling", "--no-async-scheduling", "--seed", "1", "--seed", "2"],
    ["generate", "hi", "--kv-cache-dtype", "bfloat16", "--prefix-caching-hash-algo", "xxhash",
     "--prefix-caching-hash-seed", "s3cret", "--kv-cache-dir", "/tmp/kv", "--dtype", "float16",
     "--scheduling-policy", "fcfs", "--preemption-mode", "swap", "--attention-backend", "xla",
     "--logprobs-mode", "raw_logprobs"],
    ["generate", "hi", "--swap-space", "2", "--kv-offloading-size", "1.5",
     "--distributed-timeout-s", "30", "--gpu-memory-utilization", "1"],
    ["generate", "hi", "--max-num-batched-tokens", "512", "--max-model-len", "1024",
     "--long-prefill-token-threshold", "64", "--max-num-seqs", "8", "--tensor-parallel-size",
     "2", "--seed", "7", "--max-logprobs", "-1"],
    ["generate", "hi", "--max-logprobs=0", "--block-size=64", "--dtype=bfloat16"],
    ["generate", "hi", "--kv-events-config",
     '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}',
     "--kv-transfer-config",
     '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}',
     "--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}'],
    ["generate", "hi", "--kv-transfer-config", '{"kv_connector": "JaxTransferConnector", '
     '"kv_role": "kv_producer", "kv_port": 14579}', "--structured-outputs-config", "{}"],
    ["generate", "hi", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
     "--master-port", "12345"],
    ["generate", "hi", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
     "--master-port", "12345", "--distributed-timeout-s", "5.5"],
    ["serve"],
    ["serve", "-m", "x", "--disable-log-stats", "--host", "0.0.0.0", "--port", "9000",
     "--max-model-len", "64", "--num-gpu-blocks-override", "16", "--no-async-scheduling"],
    ["serve", "--engine-core-process", "--kv-events-config", '{"enable_kv_cache_events": true}',
     "--max-logprobs", "5", "--enable-prefix-caching"],
    ["serve", "-dp", "2", "--routing-policy", "round_robin", "--block-size", "8"],
    ["serve", "--data-parallel-size", "1", "--prefill-replicas", "1", "--decode-replicas", "1",
     "--kv-cache-dtype", "fp8_e5m2"],
    ["serve", "--nnodes", "3", "--node-rank", "2", "--no-enable-chunked-prefill",
     "--max-num-batched-tokens", "4096", "--max-model-len", "4096"],
    ["serve", "--disable-log-stats", "--nnodes", "2", "--node-rank", "1"],
    ["chat"],
    ["chat", "--seed", "3", "--no-async-scheduling", "--temperature", "0", "-m", "m",
     "--max-tokens", "9", "--system", "be brief", "--kv-offloading-size", "0.25"],
    ["bench"],
    ["bench", "--num-prompts", "2", "--kv-cache-dtype", "bfloat16", "--engine-core-process",
     "--seed", "11", "--no-warmup"],
    ["tune", "--synthetic", "n=4", "--block-size", "8", "--max-num-seqs", "32",
     "--no-enable-prefix-caching", "--kv-offloading-size", "2"],
    ["tune", "--quick", "-m", "x", "--attention-backend", "reference"],
    ["estimate"],
    ["estimate", "-m", "cfg.json", "--block-size", "32", "--kv-cache-dtype", "fp8",
     "--max-model-len", "4096", "--tensor-parallel-size", "2", "--max-num-seqs", "64",
     "--dtype", "bfloat16", "--gpu-memory-utilization", "0.8", "--max-num-batched-tokens",
     "4096", "--gpu-memory", "24GiB", "--avg-len", "300"],
]

# Bad values: the exit status and the message (which names the flag) must stay as they were.
BAD: list[list[str]] = [
    ["generate", "hi", "--block-size", "abc"],
    ["generate", "hi", "--block-size", "12"],
    ["generate", "hi", "--gpu-memory-utilization", "1.5"],
    ["generate", "hi", "--gpu-memory-utilization", "most"],
    ["generate", "hi", "--kv-cache-dtype", "int4"],
    ["generate", "hi", "--max-num-seqs", "0"],
    ["generate", "hi", "--seed", "1.5"],
    ["generate", "hi", "--swap-space", "-1"],
    ["generate", "hi", "--logprobs-mode", "raw_logits"],
    ["generate", "hi", "--max-logprobs", "-2"],
    ["generate", "hi", "--prefix-caching-hash-algo", "md5"],
    ["generate", "hi", "--max-num-seqs"],
    ["generate", "hi", "--prefix-caching-hash-seed", ""],
    ["generate", "hi", "--enable-prefix-caching=false"],
    ["generate", "hi", "--kv-transfer-config", "{not json"],
    ["generate", "hi", "--kv-transfer-config", '{"kv_role": "sender"}'],
    ["generate", "hi", "--kv-events-config",
     '{"enable_kv_cache_events": true, "publisher": 1}'],
    ["generate", "hi", "--structured-outputs-config", '{"backend": "xgrammar"}'],
    ["serve", "--max-model-len", "-3"],
    ["serve", "--nnodes", "2", "--node-rank", "5"],
    ["serve", "--master-port", "70000"],
    ["chat", "--tensor-parallel-size", "0"],
    ["bench", "--scheduling-policy", "lifo"],
    ["tune", "--preemption-mode", "drop"],
    ["tune", "--swap-space", "1"],
    ["tune", "--nnodes", "2"],
    ["estimate", "--block-size", "x"],
]


class Captured(Exception):
    """Raised by the fakes: what the command was about to build the engine from."""

    def __init__(self, target: str, value: Any) -> None:
        super().__init__(target)
        self.target = target
        self.value = value


def _validated(target: str, args: Any) -> Captured:
    """Validate as the real engine does (errors reach the CLI as the engine's would)."""
    args.create_engine_config(model_max_len=8192)
    return Captured(target, args)


def _fake_create_engine(args: Any, loaded: Any = None) -> Any:
    if not isinstance(args.engine_core_process, bool):  # create_engine's own check
        raise ValueError(f"EngineArgs.engine_core_process must be True or False, got "
                         f"{args.engine_core_process!r}")
    raise _validated("create_engine", args)


def _fake_dp_client(args: Any, *a: Any, **k: Any) -> Any:
    raise _validated("DPEngineClient", args)


def _fake_run_worker(args: Any, *a: Any, **k: Any) -> Any:
    raise _validated("run_worker", args)


def _fake_tune(args: Any, **k: Any) -> Any:
    raise _validated("tune", args)


def _fake_estimate(model: Any = None, **kwargs: Any) -> Any:
    raise Captured("estimate_capacity", {"model": model, **kwargs})


@contextlib.contextmanager
def fakes() -> Iterator[None]:
    """Replace every engine constructor the commands reach, wherever this version keeps it."""
    targets = [(mod, "create_engine", _fake_create_engine)
               for mod in ("jpaged.llm", "jpaged.engine_core", "jpaged.core_client",
                           "jpaged.async_engine")]
    targets += [("jpaged.dp.client", "DPEngineClient", _fake_dp_client),
                ("jpaged.multiprocess_worker", "run_worker", _fake_run_worker),
                ("jpaged.tune.command", "tune", _fake_tune),
                ("jpaged.estimate", "estimate_capacity", _fake_estimate)]
    modules = {}
    for mod_name, _, _ in targets:  # all imported before any is patched: none binds a fake
        with contextlib.suppress(ImportError):
            modules[mod_name] = importlib.import_module(mod_name)
    with contextlib.ExitStack() as stack:
        for mod_name, attr, fake in targets:
            if hasattr(modules.get(mod_name), attr):
                stack.enter_context(mock.patch.object(modules[mod_name], attr, fake))
        yield


def _plain(value: Any) -> Any:
    """A value as JSON keeps it: JSON tells 2 from 2.0 and 1 from true, so the types survive;
    anything else (not expected from a command line) by its repr."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return f"<{type(value).__name__}> {value!r}"


def typed(value: Any) -> Any:
    """A comparable form of a value that also compares types (2 != 2.0, 1 != True)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


def capture(argv: list[str]) -> dict[str, Any]:
    """What `jpaged ARGV` builds: {"target", "args"}, or {"exit_code", "output"}."""
    from typer.testing import CliRunner

    from jpaged.cli import app

    with fakes():
        r = CliRunner().invoke(app, argv, input="", env={"COLUMNS": "80"}, terminal_width=80)
    if isinstance(r.exception, Captured):
        value = r.exception.value
        fields = (dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
        return {"target": r.exception.target,
                "args": {k: _plain(v) for k, v in sorted(fields.items())}}
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise RuntimeError(f"{argv}: {r.exception!r}") from r.exception
    return {"exit_code": r.exit_code, "output": r.output}


def capture_all() -> dict[str, Any]:
    """Every case: {"good": [[argv, result], ...], "bad": [...]}."""
    return {"good": [[argv, capture(argv)] for argv in GOOD],
            "bad": [[argv, capture(argv)] for argv in BAD]}


if __name__ == "__main__":
    import jpaged

    print(f"capturing {jpaged.__file__}", file=sys.stderr)
    cases = capture_all()
    with open(sys.argv[1], "w") as f:  # one case a line
        f.write("{\n")
        for i, kind in enumerate(("good", "bad")):
            f.write(f'"{kind}": [\n')
            f.write(",\n".join(json.dumps(c) for c in cases[kind]))
            f.write("\n]" + (",\n" if i == 0 else "\n"))
        f.write("}\n")

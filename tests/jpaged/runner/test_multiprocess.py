"""One model over 3 processes on 127.0.0.1 (one CPU device each, gloo collectives): `jpaged
generate` and `jpaged serve` give tensor_parallel_size 1's tokens; a killed process ends the run
on process 0 with the documented error in bounded time; mismatches and no-shows are refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import openai
import pytest
from flax import nnx
from helpers import embedded, free_port, make_llm, tiny_model_dir, xla_flags

from jpaged import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 240  # bound on every wait here (3 processes share 2 cores while compiling)
PROMPT = "The capital of France is"
FLAGS = ["--tensor-parallel-size", "3", "--nnodes", "3", "--max-model-len", "128",
         "--max-num-seqs", "4", "--distributed-timeout-s", "60"]


class Procs:
    """Processes started by one test, each with its own output files; all ended on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        tmp.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                        XLA_FLAGS=xla_flags())

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
        err = open(self.tmp / f"{name}.err", "w")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "jpaged.cli", *args], cwd=ROOT, env=self.env,
                             stdout=out, stderr=err, start_new_session=True)
        p.files = (out, err)  # type: ignore[attr-defined]
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def wait(self, p: subprocess.Popen, timeout: float = WAIT_S) -> int:
        return p.wait(timeout=timeout)

    def text(self, name: str, stream: str = "err") -> str:
        return (self.tmp / f"{name}.{stream}").read_text()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            for f in p.files:  # type: ignore[attr-defined]
                f.close()


_LOADED = re.compile(r"process (\d) of 3 loaded its parameter slices: (\d+) bytes on its "
                     r"devices; peak RSS (\d+) bytes, (\d+) before loading")


def _loading_facts(procs: Procs, names: list[str]) -> list[tuple[int, int, int]]:
    """(bytes on its devices, peak RSS, RSS before loading) per process, from their logs."""
    facts = []
    for name in names:
        m = _LOADED.search(procs.text(name))
        assert m, procs.text(name)[-3000:]
        facts.append((int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return facts


@pytest.fixture(scope="module")
def tp1_tokens() -> list[int]:
    """The embedded model's greedy tokens at tensor_parallel_size 1 (the reference)."""
    llm = make_llm(embedded(), max_model_len=128, max_num_seqs=4)
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))[0] \
        .outputs[0].token_ids


def test_generate_over_three_processes_equals_tp1(tmp_path, tp1_tokens):
    """`jpaged generate` with tp 3 over 3 processes: tp 1's tokens; every process loads only
    its third of the parameters, its peak memory while loading bounded; all exit 0."""
    port = str(free_port(2))
    with Procs(tmp_path) as procs:
        workers = [procs.start(f"w{r}", "generate", "-v", *FLAGS, "--node-rank", str(r),
                               "--master-port", port) for r in (1, 2)]
        lead = procs.start("w0", "generate", PROMPT, "--raw", "--temperature", "0",
                           "--max-tokens", "12", "--json", "-v", *FLAGS, "--node-rank", "0",
                           "--master-port", port)
        assert procs.wait(lead) == 0, procs.text("w0")[-3000:]
        for w in workers:
            assert procs.wait(w, 60) == 0, procs.text(w.name)[-3000:]
        rec = json.loads(procs.text("w0", "out").strip().splitlines()[-1])
        assert rec["token_ids"] == tp1_tokens
        for r in (1, 2):
            assert "process 0 said stop" in procs.text(f"w{r}")
        facts = _loading_facts(procs, ["w0", "w1", "w2"])
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(embedded().model))
    params = sum(x.nbytes for _, x in leaves)
    largest = max(x.nbytes for _, x in leaves)  # one Param is one checkpoint tensor
    for mine, peak, before in facts:
        assert abs(mine - params / 3) < params / 100  # a third (norms are replicated)
        # Loading took at most its third, one whole tensor (the f32 embedding) and the
        # tokenizer and reader metadata (< 64 MiB); docs/distributed.md reports the numbers.
        assert peak - before < params / 3 + largest + 64 * 2**20, (peak, before, params)


def test_serve_over_three_processes_then_a_killed_process_ends_the_run(tmp_path, tp1_tokens):
    """`jpaged serve` over 3 processes, from a `jpaged convert` checkpoint (each process
    restores its shards with orbax, collectively), answers the openai client with tp 1's
    tokens; SIGKILL of process 2 mid-stream fails that stream and ends process 0 with the
    documented error."""
    from models.checkpoint import save_checkpoint

    ckpt = str(save_checkpoint(embedded(), tmp_path / "ckpt"))
    port = str(free_port(2))
    http = free_port()
    with Procs(tmp_path) as procs:
        workers = [procs.start(f"s{r}", "serve", "--model", ckpt, *FLAGS, "--node-rank",
                               str(r), "--master-port", port) for r in (1, 2)]
        lead = procs.start("s0", "serve", "--model", ckpt, *FLAGS, "--node-rank", "0",
                           "--master-port", port, "--port", str(http),
                           "--served-model-name", "m")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none",
                               max_retries=0, timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:
            assert lead.poll() is None, procs.text("s0")[-3000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        done = client.completions.create(model="m", prompt=PROMPT, max_tokens=12,
                                         temperature=0.0)
        ref = embedded().tokenizer.decode(tp1_tokens)
        assert done.choices[0].text == ref

        stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=100,
                                           temperature=0.0, stream=True)
        got, failed = [], None
        try:
            for chunk in stream:
                got.append(chunk.choices[0].text)
                if len(got) == 3:
                    os.kill(workers[1].pid, signal.SIGKILL)
        except (openai.APIError, ValueError) as e:  # the server's error event, or it is gone
            failed = e
        t_kill = time.monotonic()
        assert failed is not None or len(got) < 100, "the stream ran to its end"
        assert procs.wait(lead, 120) == 1
        assert time.monotonic() - t_kill < 120
        err = procs.text("s0")
        assert "a multi-process step failed: another process died or left the mesh" in err, \
            err[-3000:]
        assert procs.wait(workers[0], 120) != 0  # process 1 ends too (no hang)


def test_mismatched_flags_are_refused_naming_the_difference(tmp_path):
    """Process 1 with another --max-model-len: both refuse at start-up, naming the field."""
    port = str(free_port(2))
    base = ["generate", "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", port,
            "--distributed-timeout-s", "30"]
    with Procs(tmp_path) as procs:
        other = procs.start("p1", *base, "--node-rank", "1", "--max-model-len", "64")
        lead = procs.start("p0", *base, "hello", "--node-rank", "0", "--max-model-len", "128")
        assert procs.wait(lead, 120) == 2 and procs.wait(other, 120) == 2
        for name in ("p0", "p1"):
            assert ("process 1 differs from process 0 in max_model_len: 128 (process 0) != 64"
                    in procs.text(name)), procs.text(name)[-2000:]


def test_a_process_that_never_joins_is_named_in_bounded_time(tmp_path):
    port = str(free_port(2))
    with Procs(tmp_path) as procs:
        t0 = time.monotonic()
        lead = procs.start("p0", "generate", "hello", "--tensor-parallel-size", "2",
                           "--nnodes", "2", "--node-rank", "0", "--master-port", port,
                           "--distributed-timeout-s", "3")
        assert procs.wait(lead, 60) == 1
        assert time.monotonic() - t0 < 60
        assert "process(es) [1] never said hello" in procs.text("p0")


def _serve_pair(procs: Procs) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The tiny model served over 2 processes (tp 2); returns (process 0, process 1) once up."""
    port, http = str(free_port(2)), free_port()
    flags = ["serve", "--model", str(tiny_model_dir()), "--tensor-parallel-size", "2",
             "--nnodes", "2", "--master-port", port, "--max-model-len", "64",
             "--distributed-timeout-s", "60"]
    other = procs.start("p1", *flags, "--node-rank", "1")
    lead = procs.start("p0", *flags, "--node-rank", "0", "--port", str(http))
    deadline = time.monotonic() + WAIT_S
    while "Uvicorn running" not in procs.text("p0"):
        assert lead.poll() is None and other.poll() is None, procs.text("p0")[-3000:]
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.3)
    return lead, other


def test_a_process_dying_while_idle_ends_the_others(tmp_path):
    """No step running: process 1 killed -> process 0 exits 1 naming it; process 0 killed ->
    process 1 ends, in bounded time: our error (exit 1) or JAX's coordination client, which
    loses the service process 0 hosted and aborts the process itself (whichever is first)."""
    with Procs(tmp_path / "a") as procs:
        lead, other = _serve_pair(procs)
        os.kill(other.pid, signal.SIGKILL)
        assert procs.wait(lead, 60) == 1
        assert "a process of the mesh is gone" in procs.text("p0"), procs.text("p0")[-2000:]
    with Procs(tmp_path / "b") as procs:
        lead, other = _serve_pair(procs)
        os.kill(lead.pid, signal.SIGKILL)
        assert procs.wait(other, 60) in (1, -signal.SIGABRT)
        err = procs.text("p1")
        assert ("process 0 is gone" in err
                or "JAX distributed service detected fatal errors" in err), err[-2000:]


# ---- no processes started: settings refused before joining anyone ------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(nnodes=0), "nnodes"),
    (dict(nnodes=2, node_rank=2), "node_rank"),
    (dict(nnodes=2, master_port=65535), "master_port"),
    (dict(nnodes=2, master_addr=""), "master_addr"),
    (dict(nnodes=2, distributed_timeout_s=0), "distributed_timeout_s"),
    (dict(nnodes=2, data_parallel_rank=0), "nnodes"),
])
def test_bad_multiprocess_settings_name_the_field(kwargs, field):
    from jpaged.config import EngineArgs

    with pytest.raises(ValueError, match=rf"ParallelConfig\.{field} must be"):
        EngineArgs(**kwargs).create_engine_config(1024)


def test_what_only_process_0_may_build_is_refused_before_joining():
    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine

    with pytest.raises(ValueError, match="run_worker"):
        LLMEngine(EngineArgs(nnodes=2, node_rank=1))
    with pytest.raises(ValueError, match="host and disk KV tiers are not supported"):
        LLMEngine(EngineArgs(nnodes=2, kv_offloading_size=1.0))
    with pytest.raises(ValueError, match="preloaded model"):
        LLMEngine(EngineArgs(nnodes=2), loaded=embedded())


def test_fingerprints_differ_only_where_it_matters():
    from jpaged.config import EngineArgs
    from jpaged.runner.multiprocess import fingerprint, first_difference

    base = fingerprint(EngineArgs(nnodes=2))
    assert first_difference(base, fingerprint(EngineArgs(nnodes=2, node_rank=1,
                                                          async_scheduling=False))) is None
    assert first_difference(base, fingerprint(EngineArgs(nnodes=2, block_size=32))) == \
        "block_size: 16 (process 0) != 32"
    other = fingerprint(EngineArgs(nnodes=2, model=str(tiny_model_dir())))
    assert first_difference(base, other).startswith("model: ")

"""Data-parallel serving on a real local Ray cluster (2 CPUs) and a real server on 127.0.0.1,
driven by the official openai client: two replicas answer what one engine answers, streams and
client disconnects pass through the router, kv_aware sends a shared prefix where it is cached,
/health and /metrics report per replica, and a replica killed mid-stream fails only its own
requests while the server keeps answering and Ray restarts it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from helpers import tiny_model_dir

from jpaged import SamplingParams
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv
from jpaged.server import BackgroundServer, build_app

ray = pytest.importorskip("ray")
# ray.init starts its processes with subprocess (fork + exec at once): JAX's warning about
# fork in a threaded process does not apply.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

MODEL = "tiny-dp"
ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
            num_gpu_blocks_override=96, disable_log_stats=True)
WAIT_S = 120  # bound on every wait here


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for this module; the workers share the suite's XLA cache."""
    import jax

    cache = jax.config.jax_compilation_cache_dir  # set by tests/conftest.py
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"JAX_COMPILATION_CACHE_DIR": str(cache),
                                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
                                       "JAX_PLATFORMS": "cpu"}})
    try:
        yield
    finally:
        ray.shutdown()


def _serve(policy: str):
    from jpaged.dp.client import DPEngineClient

    # Half a CPU each: two servers' replicas fit the 2-CPU cluster at once.
    client = DPEngineClient(EngineArgs(model=str(tiny_model_dir()), **ARGS), 2, policy,
                            ready_timeout=WAIT_S, replica_cpus=0.5)
    return client, BackgroundServer(build_app(client, MODEL, owned=True))


@pytest.fixture(scope="module")
def rr(cluster):
    """DP=2 behind a round-robin router (so both replicas get requests, deterministically)."""
    client, server = _serve("round_robin")
    try:
        yield client, server
    finally:
        server.stop()


def _oai(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=WAIT_S)


PROMPTS = ["one two three four", "five six seven", "eight nine ten eleven twelve", "a b c"]


def _wait(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_dp2_answers_equal_one_engines(rr):
    client, server = rr
    oai = _oai(server)
    got = [oai.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
           for p in PROMPTS]
    chat = oai.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "hello there"}])
    one = LLMEngine(EngineArgs(model=str(tiny_model_dir()), **ARGS))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    from jpaged import LLM

    llm = LLM.from_engine(one)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    want_chat = llm.chat([{"role": "user", "content": "hello there"}],
                         SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert chat.choices[0].message.content == want_chat[0].outputs[0].text
    # Beam search through the router: each step's beams may land on either replica.
    from jpaged import BeamSearchParams

    beams = oai.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=4,
                                   extra_body={"use_beam_search": True, "ignore_eos": True,
                                               "return_token_ids": True})
    want_beams = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4,
                                                              ignore_eos=True))
    assert [c.model_extra["token_ids"] for c in beams.choices] == [
        s.output_token_ids for s in want_beams[0].sequences]
    # Both replicas served (round robin), and /health lists them.
    health = httpx.get(f"{server.url}/health", timeout=30).json()["replicas"]
    assert [h["healthy"] for h in health] == [True, True]
    assert all(h["requests_routed"] >= 2 for h in health)


def test_streams_and_disconnects_pass_through_the_router(rr):
    client, server = rr

    async def run() -> tuple[list[str], int]:
        oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                 timeout=WAIT_S)
        try:
            async def one(i: int) -> str:
                # A stream to hang up on asks for what the context allows (128 tokens less a
                # prompt of at most 29), so its abort lands long before it could finish: with
                # 40 tokens the tiny model could finish first on a saturated machine, counted
                # as finished, not aborted (the likely cause of one time-out in a suite run).
                stream = await oai.completions.create(
                    model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=96 if i % 2
                    else 8, temperature=0, stream=True, extra_body={"ignore_eos": True})
                text, chunks = "", 0
                async for chunk in stream:
                    text += chunk.choices[0].text
                    chunks += 1
                    if i % 2 and chunks == 2:
                        await stream.close()  # hang up mid-stream
                        return "dropped"
                return text
            return list(await asyncio.gather(*(one(i) for i in range(8)))), 0
        finally:
            await oai.close()

    before = client.get_metrics()
    texts, _ = asyncio.run(run())
    assert texts[1::2] == ["dropped"] * 4 and all(t and t != "dropped" for t in texts[::2])
    # The hung-up requests were aborted on their replicas: nothing runs, no block is held.
    # (Replica metrics are polled twice a second: wait for the aborts to show in them.)
    aborted0 = before.get("num_requests_aborted", 0)
    _wait(lambda: client.get_metrics().get("num_requests_aborted", 0) >= aborted0 + 4
          and client.get_metrics().get("num_unfinished_requests") == 0
          and all(m.get("kv_cache_usage") == 0.0 and m.get("num_requests_running") == 0
                  for m in client.replica_metrics()), "the aborts and an idle pool")
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert f'jpaged:num_requests_running{{engine="0",model_name="{MODEL}"}}' in text
    assert f'jpaged:num_requests_running{{engine="1",model_name="{MODEL}"}}' in text
    assert 'engine="total"' in text


def _abort_from_another_task(client, rid: str, prompt: str, after_first: bool):
    """Add a long request, abort it from another task (after its first output, or at once),
    and return every output its stream then gave: it must end, with a finished one."""
    async def run():
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
        queue = await client.add_request(rid, prompt, params)
        outs = [await asyncio.wait_for(queue.get(), WAIT_S)] if after_first else []

        async def abort_soon():
            await asyncio.sleep(0)
            client.abort(rid)
        aborter = asyncio.create_task(abort_soon())
        while not (outs and outs[-1].finished):
            outs.append(await asyncio.wait_for(queue.get(), WAIT_S))
        await aborter
        return outs
    return asyncio.run(run())


def test_an_abort_from_another_task_ends_the_stream_with_the_tokens_so_far(rr):
    """As one engine's (vLLM's): a request aborted while its stream is read elsewhere ends
    with a finished output, finish_reason "abort", holding its tokens; the pool empties."""
    client, _ = rr
    outs = _abort_from_another_task(client, "dp-abort", PROMPTS[0], after_first=True)
    last = outs[-1].outputs[0]
    assert last.finish_reason == "abort" and 1 <= len(last.token_ids) < 96
    assert last.token_ids[:len(outs[0].outputs[0].token_ids)] == outs[0].outputs[0].token_ids
    _wait(lambda: client.get_metrics().get("num_unfinished_requests") == 0
          and all(m.get("kv_cache_usage") == 0.0 for m in client.replica_metrics()),
          "the abort and an idle pool")


def test_kv_aware_routes_a_shared_prefix_to_the_replica_that_holds_it(cluster):
    client, server = _serve("kv_aware")
    try:
        oai = _oai(server)
        system = " ".join(f"w{i}" for i in range(20))  # a shared prefix of several blocks
        first = oai.completions.create(model=MODEL, prompt=system + " q0", max_tokens=2,
                                       temperature=0)
        _wait(lambda: any(client.router.index.hashes_of(r) for r in range(2)),
              "the first replica's events")
        holder = next(r for r in range(2) if client.router.index.hashes_of(r))
        for i in range(1, 4):  # one at a time: no load to weigh, the prefix decides
            r = oai.completions.create(model=MODEL, prompt=f"{system} q{i}", max_tokens=2,
                                       temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert client.router.routed[holder] == 4
    finally:
        server.stop()


def test_a_killed_replica_fails_only_its_requests(rr):
    client, server = rr
    pids = [h["pid"] for h in httpx.get(f"{server.url}/health", timeout=30).json()["replicas"]]

    async def run() -> list[tuple[str, str]]:
        oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                 timeout=WAIT_S)
        started: set[int] = set()
        try:
            async def one(i: int) -> tuple[str, str]:
                stream = await oai.completions.create(
                    model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=100,
                    temperature=0, stream=True, extra_body={"ignore_eos": True})
                text = ""
                try:
                    async for chunk in stream:
                        text += chunk.choices[0].text
                        started.add(i)
                        # The first chunk that finds all four started kills replica 1 (not
                        # stream 0's next one: under load its replica may lag until replica
                        # 1's streams are done).
                        if len(started) == 4 and pids[1] is not None:
                            os.kill(pids[1], signal.SIGKILL)  # replica 1, every stream running
                            pids[1] = None
                except openai.APIError as e:
                    return "error", str(e)
                return "done", text
            return list(await asyncio.gather(*(one(i) for i in range(4))))
        finally:
            await oai.close()

    results = asyncio.run(run())
    assert pids[1] is None, "the streams ended before all four had started"
    # Round robin put two streams on each replica: replica 1's fail, naming it; the others end.
    kinds = sorted(kind for kind, _ in results)
    assert kinds == ["done", "done", "error", "error"], results
    assert all("replica 1" in detail for kind, detail in results if kind == "error")
    assert all(len(detail) > 0 for kind, detail in results if kind == "done")
    # The server keeps answering (on replica 0) while replica 1 restarts ...
    ok = _oai(server).completions.create(model=MODEL, prompt="one two", max_tokens=3,
                                         temperature=0)
    assert ok.choices[0].text

    # ... and Ray brings replica 1 back: a new process, healthy, serving again.
    def back() -> bool:
        reps = httpx.get(f"{server.url}/health", timeout=30).json()["replicas"]
        return reps[1]["healthy"] and reps[1]["pid"] not in (None, old_pid)

    old_pid = [h["pid"] for h in client.health()[1]["replicas"]][1]
    _wait(back, "replica 1 to restart")
    assert not client.router.index.hashes_of(1)  # what the dead process held is forgotten
    before = client.router.routed[1]
    long = " ".join(["five six seven"] * 8)  # several full blocks
    outs = [_oai(server).completions.create(model=MODEL, prompt=long, max_tokens=3,
                                            temperature=0).choices[0].text for _ in range(2)]
    assert outs[0] == outs[1] and client.router.routed[1] == before + 1
    # The new process's events reach the router: its blocks are indexed again.
    _wait(lambda: bool(client.router.index.hashes_of(1)), "replica 1's new events")


def test_bench_dp_routes_tenants_and_reports_every_field(cluster):
    """scripts/bench_dp.py's logic on the tiny model: the fields it reports, and kv_aware
    keeping each tenant on one replica where round robin computes each prefix twice."""
    from jpaged.bench.dp import run_policy, tenant_workload

    work = tenant_workload(tenants=3, questions=3, system_len=32, question_len=4,
                           vocab=(0, 256), seed=1)
    assert sorted(t for t, _ in work[:3]) == [0, 1, 2] and len(work) == 9
    warm = [p for _, p in tenant_workload(2, 1, 32, 4, vocab=(0, 256), seed=2)]
    args = EngineArgs(model=str(tiny_model_dir()), **ARGS)
    # One request at a time, so what each policy does does not depend on timing; 3 tenants
    # over 2 replicas make round robin move every tenant between replicas.
    rows = {p: run_policy(args, 2, p, work, warm, max_tokens=2, concurrency=1,
                          replica_cpus=0.5) for p in ("kv_aware", "round_robin")}
    for r in rows.values():
        assert r["requests"] == 9 and r["prompt_tokens"] == 9 * 36
        assert sum(r["replica_share"]) == pytest.approx(1.0, abs=0.01)
        assert r["ttft_p50_s"] > 0 and r["tokens_per_s"] > 0
    # Each tenant's 4 full blocks: computed once per tenant (kv_aware: 6 of 9 requests hit
    # 32 tokens), once per replica it visits (round robin).
    assert rows["kv_aware"]["hit_rate"] == pytest.approx(6 * 32 / (9 * 36), abs=1e-3)
    assert rows["kv_aware"]["hit_rate"] > rows["round_robin"]["hit_rate"]
    assert rows["kv_aware"]["prefill_tokens"] < rows["round_robin"]["prefill_tokens"]


def test_bad_replica_settings_fail_with_the_engines_message(rr):
    """A missing model fails before any actor starts; an engine that refuses its settings
    while starting fails the client with its own message, and no replica is left behind."""
    from jpaged.dp.client import DPEngineClient

    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        DPEngineClient(EngineArgs(model="/nonexistent/m.gguf"), 2, replica_cpus=0.5)
    # Only rr's two replicas (half a CPU each) hold CPUs. Known exactly rather than read now:
    # replicas an earlier test shut down may still be handing theirs back.
    free = ray.cluster_resources()["CPU"] - 2 * 0.5
    _wait(lambda: ray.available_resources().get("CPU") == free, "earlier replicas to go")
    with pytest.raises(ValueError, match="a replica failed to start: the KV pool"):
        DPEngineClient(EngineArgs(model=str(tiny_model_dir()), max_model_len=64,
                                  kv_cache_memory_bytes=1000), 2, replica_cpus=0.5,
                       ready_timeout=WAIT_S)
    _wait(lambda: ray.available_resources().get("CPU") == free, "the failed replicas to go")


def test_two_replicas_share_a_disk_tier(cluster, tmp_path):
    """Replicas with one kv_cache_dir: a prefix replica 0 spilled to disk is a disk hit on
    replica 1, which never computed it, with the same tokens."""
    from jpaged.dp.client import DPEngineClient

    block = 2 * 2 * 8 * 2 * 16 * 4  # tiny(): layers x K/V x block 8 x 2 heads x 16 x f32
    tiers = dict(ARGS, num_gpu_blocks_override=24, kv_offloading_size=4 * block / 2**30,
                 swap_space=200 * block / 2**30, kv_cache_dir=str(tmp_path))
    client = DPEngineClient(EngineArgs(model=str(tiny_model_dir()), **tiers), 2, "round_robin",
                            ready_timeout=WAIT_S, replica_cpus=0.5)
    server = BackgroundServer(build_app(client, MODEL, owned=True))
    oai = _oai(server)

    def ask(prompt: list[int], on: int) -> str:
        if sum(client.router.routed) % 2 != on:  # round robin: line up the next replica
            oai.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        assert client.router.routed[on] > 0
        return out

    try:
        shared = list(range(10, 74))  # 8 full blocks
        first = ask(shared, 0)
        for i in range(6):  # replica 0's device and host tiers turn over: shared goes to disk
            ask([100 + i] * 60, 0)
        _wait(lambda: client.replica_metrics()[0].get("disk_bytes_written", 0) > 0,
              "replica 0 to spill to disk")
        hits0 = client.replica_metrics()[1].get("disk_hits_blocks", 0)
        assert ask(shared, 1) == first
        _wait(lambda: client.replica_metrics()[1].get("disk_hits_blocks", 0) > hits0,
              "replica 1's disk hits to show")
    finally:
        server.stop()


def test_disaggregated_prefill_and_decode_replicas(cluster):
    """--prefill-replicas 1 --decode-replicas 1: the same greedy text as one engine (single
    prompts, a prompt past the token budget: chunked on the producer, a shared system prompt:
    the decode replica pulls only what it lacks); the transfer shows in /metrics by engine; a
    decode replica killed before it pulls leaves the producer's blocks to its timeout; every
    pool is empty afterwards."""
    from jpaged import LLM
    from jpaged.dp.client import DPEngineClient

    xfer = {"kv_connector_extra_config": {"abort_timeout_s": 3, "transfer_timeout_s": 20}}
    client = DPEngineClient(EngineArgs(model=str(tiny_model_dir()), **ARGS,
                                       kv_transfer_config=xfer), 1, "kv_aware",
                            ready_timeout=WAIT_S, replica_cpus=0.5, prefill_replicas=1,
                            decode_replicas=1)
    server = BackgroundServer(build_app(client, MODEL, owned=True))
    try:
        oai = _oai(server)
        system = " ".join(f"w{i}" for i in range(24))
        long = " ".join(["five six seven"] * 6)  # ~90 tokens > max_num_batched_tokens (64)
        prompts = ["one two three four", long, f"{system} q1", f"{system} q2"]
        got = []
        for i, p in enumerate(prompts):
            if i == 1:  # streamed through both hops
                chunks = oai.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
                got.append("".join(c.choices[0].text for c in chunks if c.choices))
            else:
                got.append(oai.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True}
                                                  ).choices[0].text)
            if i == 2:  # the decode replica's events index the system prompt
                _wait(lambda: bool(client.router.index.hashes_of(1)), "decode events")
        llm = LLM.from_engine(LLMEngine(EngineArgs(model=str(tiny_model_dir()), **ARGS)))
        want = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False)]
        assert got == want
        assert client.router.routed == [4, 4]
        _wait(lambda: client.replica_metrics()[1].get("kv_transfer_loads_total") == 4,
              "the decode replica's metrics")
        m = client.replica_metrics()
        sent, received = (m[0]["kv_transfer_blocks_sent_total"],
                          m[1]["kv_transfer_blocks_received_total"])
        assert sent == received > 0
        tok = client.tokenizer
        need = sum(cdiv(len(tok.encode(p)) - 1, 8) for p in prompts)
        assert received < need  # q2's system-prompt blocks were the decode replica's own
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        labels = f'model_name="{MODEL}"'
        assert f'jpaged:kv_transfer_blocks_sent_total{{engine="0",{labels}}}' in text
        assert f'jpaged:kv_transfer_blocks_received_total{{engine="1",{labels}}}' in text
        # A client that hangs up after its first chunk: aborted on the decode replica.
        stream = oai.completions.create(model=MODEL, prompt=long, max_tokens=30,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        # Aborted from another task at once (in its prefill hop, where the client's own pump
        # ends the stream; or, on a slow machine, in its decode): the stream ends, "abort".
        outs = _abort_from_another_task(client, "pd-abort", long, after_first=False)
        assert [(o.finished, o.outputs[0].finish_reason) for o in outs][-1] == (True, "abort")
        _wait(lambda: all(x.get("kv_cache_usage") == 0.0 and x.get("num_requests_running") == 0
                          for x in client.replica_metrics()), "both pools to empty")
        # The decode replica dies: the prefill replica's held blocks go at its timeout.
        os.kill(client.health()[1]["replicas"][1]["pid"], signal.SIGKILL)
        try:
            oai.completions.create(model=MODEL, prompt="eight nine ten eleven twelve thirteen",
                                   max_tokens=4, temperature=0)
        except openai.APIError:
            pass  # no decode replica took it (Ray had not restarted it yet)
        _wait(lambda: client.replica_metrics()[0].get("kv_cache_usage") == 0.0
              and client.replica_metrics()[0].get("kv_transfer_requests_held") == 0,
              "the producer to free what nobody pulled")
    finally:
        server.stop()


def test_bench_pd_reports_every_field(cluster):
    """scripts/bench_pd.py's logic on the tiny model, disaggregated: the fields it reports;
    greedy texts equal the co-located reference the test computes itself."""
    from jpaged import LLM
    from jpaged.bench.pd import pd_workload, run_pd

    work = pd_workload(streams=2, long_prompts=2, long_len=48, stream_len=8, decode_len=6,
                       gap_s=0.2, vocab=(0, 256), seed=3)
    assert len(work.longs[0]) == 48 and work.longs[0][:24] == work.longs[1][:24]
    args = EngineArgs(model=str(tiny_model_dir()), **ARGS)
    row = run_pd(args, True, work, pd_workload(2, 2, 48, 8, 6, gap_s=0.2, vocab=(0, 256),
                                               seed=4),
                 cores=sorted(os.sched_getaffinity(0))[:2], replica_cpus=0.5,
                 probe=work.longs[0][:40])
    assert row["disagg"] and row["requests"] == 4
    assert row["itl_p50_s"] > 0 and row["itl_p99_s"] >= row["itl_p50_s"]
    assert row["ttft_p50_s"] > 0 and row["transfer_s_per_block"] > 0
    assert row["blocks_transferred"] == row["blocks_sent"] > 0
    assert row["kv_usage_after"] == [0.0, 0.0]
    llm = LLM.from_engine(LLMEngine(EngineArgs(model=str(tiny_model_dir()), **ARGS)))
    want = {f"stream{i}": o.outputs[0].text for i, o in enumerate(llm.generate(
        [{"prompt_token_ids": p} for p in work.streams],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False))}
    assert {k: v for k, v in row["texts"].items() if k.startswith("stream")} == want


def test_lora_adapters_on_both_replicas(cluster, tmp_path):
    """--lora-modules with two replicas: every replica reads the adapter at start, a request
    naming it runs it wherever it lands (HF + peft's tokens), and a runtime load reaches
    both replicas."""
    from helpers import hf_greedy, hf_llama_twin, tiny
    from lora_fixtures import peft_model, write_peft_adapter

    from jpaged.dp.client import DPEngineClient

    hf = hf_llama_twin(tiny(), tmp_path / "hf")
    paths = {n: write_peft_adapter(hf, tmp_path / n, r=4, alpha=8, seed=s)
             for n, s in (("sql", 1), ("late", 2))}
    prompt = [1, 5, 9, 23, 44, 12]
    want = {n: hf_greedy(peft_model(hf, p), prompt, 6, (-1,)) for n, p in paths.items()}
    want[MODEL] = hf_greedy(hf, prompt, 6, (-1,))
    client = DPEngineClient(EngineArgs(model=str(tiny_model_dir()), enable_lora=True,
                                       max_lora_rank=8, **ARGS), 2, "round_robin",
                            ready_timeout=WAIT_S, replica_cpus=0.5)
    server = BackgroundServer(build_app(client, MODEL, owned=True,
                                        lora_modules=[f"sql={paths['sql']}"],
                                        allow_runtime_lora_updating=True))
    try:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                            timeout=WAIT_S)
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=WAIT_S,
                       json={"lora_name": "late", "lora_path": str(paths["late"])})
        assert r.status_code == 200, r.text
        for model in ("sql", "sql", "late", "late", MODEL, MODEL):  # round robin: both
            out = oai.completions.create(model=model, prompt=prompt, max_tokens=6,
                                         temperature=0.0, extra_body={
                                             "ignore_eos": True, "return_token_ids": True})
            assert out.model == model and out.choices[0].token_ids == want[model], model
    finally:
        server.stop()

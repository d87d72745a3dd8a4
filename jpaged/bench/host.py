"""Host work per engine step, synchronous loop vs async scheduling (the overlapped loop).

Host rows: a tiny random Llama (one layer, hidden 64) makes the device step cost next to
nothing, so what is measured is the engine's own host path: schedule, pack, dispatch, read the
tokens, update requests, detokenize, search stop strings, build DELTA outputs. `batch` requests
decode together with streaming (DELTA) and a stop string on; each `LLMEngine.step()` is timed
by the engine thread's CPU time (`time.thread_time`): the host's own work, not the time it
blocks on the device nor the time it waits for a core the device step is using. The wall time
less the device wait is reported beside it (`wall_us_per_step`).

Embedded rows: the embedded model runs the same greedy workload with both loops on one engine;
output tokens/s of each, their ratio, and whether the outputs are identical token for token
(`overlap_rows`, which the device check also runs on the GPU).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jpaged.bench.fixtures import TINY_CONFIG, random_model
from jpaged.bench.report import median
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.config import ModelSpec
from models.loader import LoadedModel
from models.tokenizer import Tokenizer

# The cheapest Llama the engine runs: the device step is a rounding error next to the host.
HOST_MODEL_CONFIG: dict[str, Any] = {
    **TINY_CONFIG, "vocab_size": 258, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 4, "tie_word_embeddings": True}
PROMPT_LEN = 16
STOP = [" w999 w0"]  # searched every step, never found: the vocabulary stops at w255


def word_tokenizer() -> Tokenizer:
    """256 word tokens (" w0" .. " w255") + <s>, </s>: every token decodes to whole text.

    A random model's tokens over a byte-level vocabulary are mostly invalid UTF-8, which no real
    model emits: the detokenizer would hold such runs back (as vLLM's does) and the benchmark
    would measure that pathology instead of streaming text.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders
    from tokenizers.models import BPE

    vocab = {f"\u0120w{i}": i for i in range(256)}
    vocab.update({"<s>": 256, "</s>": 257})
    backend = Backend(BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


def host_model() -> LoadedModel:
    """The tiny random model of HOST_MODEL_CONFIG with a word-level tokenizer."""
    import dataclasses

    import jax.numpy as jnp

    loaded = random_model(ModelSpec.from_hf_config(HOST_MODEL_CONFIG), jnp.float32)
    return dataclasses.replace(loaded, tokenizer=word_tokenizer())


def _host_args(max_batch: int, async_scheduling: bool) -> EngineArgs:
    """Engine arguments sized for `max_batch` decoding requests."""
    return EngineArgs(
        max_num_seqs=max_batch, max_model_len=512, max_num_batched_tokens=max(512, max_batch),
        num_gpu_blocks_override=max_batch * 8 + 16, block_size=16, disable_log_stats=True,
        async_scheduling=async_scheduling)


def _add_decoders(engine: Any, batch: int, seed: int) -> list[str]:
    """Queue `batch` streaming requests that nobody finishes while timed (aborted after);
    returns their ids. ValueError if the engine is not idle."""
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; benchmark an idle engine")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, stop=STOP,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"host-{batch}-{seed}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = rng.integers(0, 256, PROMPT_LEN).tolist()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return ids


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median host µs per request-step, with every round's figure."""
    # Ordered by the figure reported: the per-step one is rounded apart, and two close rounds
    # could order differently by it.
    rs = sorted(rounds, key=lambda x: x["host_us_per_request_step"])
    row = dict(rs[len(rs) // 2])
    row["host_us_per_request_step_rounds"] = [x["host_us_per_request_step"] for x in rs]
    return row


def host_engine(loaded: LoadedModel, async_scheduling: bool, max_batch: int) -> LLMEngine:
    """An engine sized for `max_batch` decoding requests, its decode shapes compiled."""
    engine = LLMEngine(_host_args(max_batch, async_scheduling), loaded=loaded)
    engine.runner.warmup([(b, b) for b in engine.runner.plan.seq_buckets])
    return engine


def measure_host(engine: LLMEngine, batch: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Median host µs per decode step (and per request per step) with `batch` requests."""
    ids = _add_decoders(engine, batch, seed)  # every step decodes all of them
    sched = engine.scheduler
    # Untimed until every request decodes (prefill done, and the overlap under way).
    while sched.num_waiting or any(r.num_output_tokens < 2 for r in sched.running):
        engine.step()
    host, wall = [], []
    streamed = 0
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = engine.step()
        host.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0 - engine.runner.last_wait_s)
        streamed += len(outs)
    engine.abort_request(ids)
    engine.step()  # drain a step still in flight
    us = median(host) * 1e6
    return {"batch": batch, "mode": "async" if engine.async_scheduling else "sync",
            "host_us_per_step": round(us, 1), "host_us_per_request_step": round(us / batch, 2),
            "wall_us_per_step": round(median(wall) * 1e6, 1),
            "outputs_per_step": streamed / steps, "steps": steps}


def host_core_engine(max_batch: int) -> Any:
    """`host_engine`'s async engine with its core in a process of its own (CoreProcessEngine),
    every decode shape compiled there."""
    from jpaged.core_client import CoreProcessEngine

    engine = CoreProcessEngine(_host_args(max_batch, True), loader=host_model)
    try:
        engine.warmup_decode()
    except BaseException:
        engine.shutdown()  # the core process ends with the failure, not at exit
        raise
    return engine


def measure_core_process(engine: Any, batch: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """`measure_host` for a CoreProcessEngine: both processes' host work per step.

    `host_us_per_step`: the core loop's thread CPU time per iteration (take messages, schedule,
    pack, dispatch, read and apply the tokens, send them): the loop the device waits on.
    `frontend_us_per_step`: the front end's thread CPU time per `step()` (apply the tokens to
    its copies, detokenize, stop strings, DELTA outputs), which runs on another core meanwhile.
    """
    ids = _add_decoders(engine, batch, seed)
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 2:  # untimed until every request decodes
        for o in engine.step():
            got[o.request_id] += len(o.outputs[0].token_ids)
    core, front = [], []
    streamed = 0
    for _ in range(steps):
        c0 = time.thread_time()
        outs = engine.step()
        front.append(time.thread_time() - c0)
        core.append(engine.last_core_loop_s)
        streamed += len(outs)
    engine.abort_request(ids)
    us, fus = median(core) * 1e6, median(front) * 1e6
    return {"batch": batch, "mode": "async", "engine_core_process": True,
            "host_us_per_step": round(us, 1), "host_us_per_request_step": round(us / batch, 2),
            "frontend_us_per_step": round(fus, 1),
            "frontend_us_per_request_step": round(fus / batch, 2),
            "outputs_per_step": streamed / steps, "steps": steps}


def core_process_rows(batches: tuple[int, ...], steps: int,
                      rounds: int = 3) -> list[dict[str, Any]]:
    """measure_core_process for every batch, each one's median round (by the core's time)."""
    engine = host_core_engine(max(batches))
    rows = []
    try:
        for b in batches:
            measure_core_process(engine, b, 2, seed=99)  # warm this batch size's paths
            rows.append(_median_round([measure_core_process(engine, b, steps, seed=r)
                                       for r in range(rounds)]))
    finally:
        engine.shutdown()
    return rows


def host_rows(batches: tuple[int, ...], steps: int, rounds: int = 3,
              engine: LLMEngine | None = None) -> list[dict[str, Any]]:
    """measure_host for every batch and both loops, the loops in turn `rounds` times.

    The machine's speed drifts between minutes; alternating the two loops and keeping each
    one's median round makes the comparison fair. One engine runs both loops
    (`set_async_scheduling`), so they share compiled steps, pool and heap: `engine` (a
    `host_engine` of at least max(batches)), or one made here.
    """
    engine = engine or host_engine(host_model(), True, max(batches))
    modes = ("sync", "async")
    rows = []
    for b in batches:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for mode in modes:  # warm the Python paths of this batch size
            engine.set_async_scheduling(mode == "async")
            measure_host(engine, b, 2, seed=99)
        for r in range(rounds):
            for mode in modes:
                engine.set_async_scheduling(mode == "async")
                runs[mode].append(measure_host(engine, b, steps, seed=r))
        rows.extend(_median_round(rs) for rs in runs.values())
    rows.sort(key=lambda x: (x["mode"] != "sync", x["batch"]))
    return rows


def overlap_rows(llm: LLM, prompts: list[Any], params: SamplingParams,
                 rounds: int = 3) -> dict[str, Any]:
    """Output tokens/s of the synchronous and the overlapped loop on one engine, outputs compared.

    The same workload runs with each loop in turn, `rounds` times, each loop first in every
    other round (so drift in the machine's speed hits both); each loop's tokens/s is from its
    median wall time, and `async_ratio` is the median of the rounds' own sync/async wall-time
    ratios. One engine runs both (`set_async_scheduling`): the same compiled steps and pool.
    The engine is left in the loop it had.
    """
    engine = llm.llm_engine
    was_async = engine.async_scheduling
    modes = ("sync", "async")
    outputs: dict[str, list[list[int]]] = {}
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for mode in modes:  # compile every shape the workload uses, warm both loops
            engine.set_async_scheduling(mode == "async")
            llm.generate(prompts, params, use_tqdm=False)
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                engine.set_async_scheduling(mode == "async")
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls[mode].append(time.perf_counter() - t0)
                outputs[mode] = [o.outputs[0].token_ids for o in outs]
    finally:
        if not engine.has_unfinished_requests():  # else a failure is on its way up: keep it
            engine.set_async_scheduling(was_async)
    res: dict[str, Any] = {"rounds": rounds}
    for mode in modes:
        res[f"tokens_per_s_{mode}"] = round(sum(map(len, outputs[mode])) / median(walls[mode]),
                                            2)
        res[f"wall_s_{mode}"] = [round(w, 3) for w in walls[mode]]
    # The ratio within each round: its two runs are back to back, so the machine's drift
    # between rounds cancels. `async_ratio` is their median; the ratio of the two loops'
    # median tokens/s compares runs from different rounds (different minutes) and is kept
    # beside it for reference only.
    res["async_ratio_per_round"] = [round(s / a, 3)
                                    for s, a in zip(walls["sync"], walls["async"], strict=True)]
    res["async_ratio"] = round(median(res["async_ratio_per_round"]), 3)
    res["async_ratio_of_medians"] = round(res["tokens_per_s_async"] / res["tokens_per_s_sync"],
                                          3)
    res["outputs_identical"] = outputs["sync"] == outputs["async"]
    return res


def embedded_rows(num_prompts: int, max_tokens: int, loaded: LoadedModel | None = None,
                  rounds: int = 3) -> dict[str, Any]:
    """`overlap_rows` on the embedded model: `num_prompts` greedy prompts of 8..63 tokens."""
    from models.loader import load_model

    loaded = loaded or load_model(None, dtype="float32")
    rng = np.random.default_rng(0)
    hi = min(20000, loaded.spec.vocab_size)
    prompts = [{"prompt_token_ids": rng.integers(hi // 4, hi, int(n)).tolist()}
               for n in rng.integers(8, 64, num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM.from_engine(LLMEngine(EngineArgs(
        max_num_seqs=max(16, num_prompts), max_model_len=512, disable_log_stats=True,
        kv_cache_memory_bytes=256 * 2**20), loaded=loaded))
    return {"num_prompts": num_prompts, "max_tokens": max_tokens,
            **overlap_rows(llm, prompts, params, rounds)}


def timeline(engine: LLMEngine, batch: int, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Host phases and device spans of `steps` decode steps with `batch` requests.

    The engine's own methods are wrapped for the run (and restored): `schedule`, the runner's
    `dispatch` (pack + the jitted call; on XLA:CPU the wait for the running step before it is
    shown apart), the result read (waiting on the device) and the output processing. A step's
    device span runs from its dispatch until the host first sees it done (the wait before the
    next dispatch, or its result read): an upper bound on the device's busy time.
    """
    events: list[dict[str, Any]] = []
    sched, runner, core = engine.scheduler, engine.runner, engine.core
    real_schedule, real_dispatch = sched.schedule, runner.dispatch
    real_apply, real_outputs = core._apply, engine._outputs
    step_no = [0]

    def span(lane: str, name: str, fn: Any, *a: Any) -> Any:
        t0 = time.perf_counter()
        res = fn(*a)
        events.append({"lane": lane, "name": name, "step": step_no[0], "t0": t0,
                       "t1": time.perf_counter()})
        return res

    ready: dict[int, float] = {}  # dispatched step -> when a wait before the next saw it done
    last = [0]  # the latest dispatched step

    def dispatch(scheduled: Any) -> Any:
        if runner.wait_before_dispatch and runner.last_tokens is not None:
            # XLA:CPU: the dispatch would wait for the running step; show that wait apart.
            span("host", "wait for previous step", runner.last_tokens.block_until_ready)
            ready[last[0]] = events[-1]["t1"]
        pending = span("host", "pack + dispatch", real_dispatch, scheduled)
        k, t_d = step_no[0], time.perf_counter()
        last[0] = k
        real_result = pending.result

        def result() -> Any:
            res = span("host", "wait for tokens", real_result)
            events.append({"lane": "device", "name": f"step {k}", "step": k, "t0": t_d,
                           "t1": min(events[-1]["t1"], ready.get(k, float("inf")))})
            return res

        pending.result = result
        return pending

    sched.schedule = lambda: span("host", "schedule", real_schedule)
    runner.dispatch = dispatch
    # Reading and applying the tokens, then text and outputs: both "process outputs".
    core._apply = lambda *a: span("host", "process outputs", real_apply, *a)
    engine._outputs = lambda *a: span("host", "process outputs", real_outputs, *a)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, stop=STOP,
                            output_kind=RequestOutputKind.DELTA)
    try:
        for i in range(batch):
            prompt = rng.integers(0, 256, PROMPT_LEN).tolist()
            engine.add_request(f"tl-{i}", {"prompt_token_ids": prompt}, params)
        while sched.num_waiting or any(r.num_output_tokens < 2 for r in sched.running):
            engine.step()
        events.clear()
        for _ in range(steps):
            step_no[0] += 1
            engine.step()
    finally:
        del sched.schedule, runner.dispatch, core._apply, engine._outputs
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    t_start = min(e["t0"] for e in events)
    return [dict(e, t0=round((e["t0"] - t_start) * 1e3, 3), t1=round((e["t1"] - t_start) * 1e3, 3))
            for e in events]


def plot_timeline(ax: Any, events: list[dict[str, Any]], title: str) -> None:
    """Host phases (one lane) above device spans (one lane), in ms."""
    colors = {"schedule": "#e08a2c", "pack + dispatch": "#c0392b", "wait for tokens": "#bbbbbb",
              "wait for previous step": "#dddddd", "process outputs": "#8e44ad"}
    seen = set()
    prev_end = float("-inf")
    for e in sorted(events, key=lambda e: (e["lane"], e["t0"])):
        if e["lane"] == "device":  # one stream: a step queued behind another starts after it
            e = dict(e, t0=max(e["t0"], prev_end))
            prev_end = e["t1"]
        if e["lane"] == "host":
            label = e["name"] if e["name"] not in seen else None
            seen.add(e["name"])
            ax.barh(1, e["t1"] - e["t0"], left=e["t0"], color=colors[e["name"]], label=label)
        else:
            ax.barh(0, e["t1"] - e["t0"], left=e["t0"], color="#2a7ab9",
                    edgecolor="white", label="device step (until the host sees it done)"
                    if "device" not in seen else None)
            seen.add("device")
            ax.text((e["t0"] + e["t1"]) / 2, 0, e["name"], ha="center", va="center",
                    color="white", fontsize=7)
    ax.set_yticks([0, 1], ["device", "host"])
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3)

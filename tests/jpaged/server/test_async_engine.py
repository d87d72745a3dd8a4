"""AsyncLLMEngine: streaming, early exit aborts, a failing step fails only its requests,
shutdown fails what is in flight."""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny
from serverkit import ENGINE_ARGS

from jpaged.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind, SamplingParams

DELTA = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA)


async def _collect(engine: AsyncLLMEngine, prompt: str, params: SamplingParams) -> list:
    return [out async for out in engine.generate(prompt, params)]


def test_generate_streams_deltas_that_add_up(served):
    engine = served.engine
    outs = asyncio.run(_collect(engine, "async hello", DELTA))
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = asyncio.run(_collect(engine, "async hello", DELTA.clone(
        output_kind=RequestOutputKind.FINAL_ONLY)))
    assert len(final) == 1
    assert "".join(o.outputs[0].text for o in outs) == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 10


def test_leaving_early_aborts_and_frees(served):
    engine = served.engine
    aborted0 = engine.engine.stats["num_requests_aborted"]

    async def two_then_leave() -> int:
        n = 0
        async for _ in engine.generate("leave early", DELTA.clone(max_tokens=100)):
            n += 1
            if n == 2:
                break
        return n

    assert asyncio.run(two_then_leave()) == 2
    m = served.wait_drained(timeout=30)
    assert engine.engine.stats["num_requests_aborted"] == aborted0 + 1
    assert m["kv_cache_usage"] == 0.0


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY,
                                  RequestOutputKind.CUMULATIVE])
def test_an_abort_from_another_task_ends_the_stream(served, kind):
    """As vLLM's test_abort_final_output: aborting a request whose stream another task reads
    ends that stream with a finished output (finish_reason "abort", the tokens so far; a
    FINAL_ONLY stream gets them all in it) instead of leaving the reader waiting."""
    engine = served.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=kind)

    async def run() -> list:
        outs: list = []
        started = asyncio.Event()

        async def read() -> None:
            async for out in engine.generate("abort me", params, request_id=f"abort-{kind}"):
                outs.append(out)
                started.set()

        reader = asyncio.create_task(read())
        if kind is RequestOutputKind.FINAL_ONLY:  # nothing streams: abort once it runs
            for _ in range(6000):
                if engine.get_metrics().get("num_requests_running"):
                    break
                await asyncio.sleep(0.01)
        else:
            await asyncio.wait_for(started.wait(), 60)
        engine.abort(f"abort-{kind}")
        await asyncio.wait_for(reader, 60)
        return outs

    before = served.metrics()
    outs = asyncio.run(run())
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "abort" and last.stop_reason is None
    # Counted as vLLM counts it: not in request_success (summed here over its reasons), which
    # counts what the engine finished; in jpaged's num_requests_aborted.
    served.wait_drained()
    after = served.metrics()
    for key, grew in (("jpaged:request_success_total", 0),
                      ("jpaged:num_requests_aborted_total", 1)):
        assert after[key] == before.get(key, 0.0) + grew, key
    n = (sum(len(o.outputs[0].token_ids) for o in outs) if kind is RequestOutputKind.DELTA
         else len(last.token_ids))
    assert n < 100 and (n > 0 or kind is RequestOutputKind.FINAL_ONLY)
    if kind is not RequestOutputKind.DELTA:
        assert last.text == served.engine.tokenizer.decode(last.token_ids)
    assert served.wait_drained()["num_requests_running"] == 0


def test_bad_request_raises_value_error_and_adds_nothing(served):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(_collect(served.engine, "x" * 500, DELTA))
    assert served.engine.get_metrics()["num_unfinished_requests"] == 0


def test_failing_step_fails_its_requests_and_the_loop_goes_on(served):
    engine = served.engine
    core = engine.engine
    real_step = core.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real_step()

    async def run() -> list:
        return await asyncio.gather(
            *(_collect(engine, f"victim {i}", DELTA.clone(max_tokens=50)) for i in range(3)),
            return_exceptions=True)

    core.step = flaky_step  # instance attribute: the loop thread calls this one
    try:
        results = asyncio.run(run())
    finally:
        del core.step
    assert all(isinstance(r, RequestFailedError) for r in results), results
    assert "injected device failure" in str(results[0])
    served.wait_drained(timeout=30)
    assert engine.is_running
    outs = asyncio.run(_collect(engine, "after the failure", DELTA))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_shutdown_fails_requests_in_flight():
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=tiny()))

    async def run() -> BaseException | None:
        try:
            async for _ in engine.generate("shut down", DELTA.clone(max_tokens=100)):
                await asyncio.to_thread(engine.shutdown)
        except EngineDeadError as e:
            return e
        return None

    assert isinstance(asyncio.run(run()), EngineDeadError)
    assert not engine.is_running and engine.dead_error is None  # a clean stop, not a crash
    assert not engine.engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "too late", DELTA))
    unstarted = AsyncLLMEngine(engine.engine, start=False)
    unstarted.shutdown()
    assert not unstarted.is_running


def test_a_request_the_engine_failed_gets_a_json_500(served):
    """Over HTTP, a non-streaming request whose step failed gets OpenAI's error body, naming
    the failure, and the server keeps answering."""
    import httpx
    from serverkit import MODEL

    core = served.engine.engine

    def failing_step():
        del core.step  # fail once
        raise RuntimeError("injected device failure")

    core.step = failing_step
    try:
        r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "fails", "max_tokens": 5})
    finally:
        core.__dict__.pop("step", None)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected device failure" in err["message"]
    served.wait_drained(timeout=30)
    ok = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "works", "max_tokens": 3})
    assert ok.status_code == 200


def test_an_add_cancelled_while_the_engine_adds_it_is_aborted_and_the_loop_lives():
    """A caller cancelled while the loop thread is inside LLMEngine.add_request (a client
    gone during a burst): the request, added after all, is aborted and the loop serves on.
    Before, the cancel landed between the loop's cancelled() check and set_result, whose
    InvalidStateError stopped the loop with the request added and never aborted."""
    import threading

    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=tiny()))
    core = engine.engine
    entered, release = threading.Event(), threading.Event()

    def slow_add(*args, **kwargs):
        entered.set()
        release.wait(30)
        return LLMEngine.add_request(core, *args, **kwargs)

    core.add_request = slow_add  # instance attribute: the loop thread calls this one

    async def run() -> None:
        task = asyncio.create_task(engine.add_request("cut-short", "x", DELTA))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    try:
        asyncio.run(run())
        del core.add_request
        assert engine.wait_until_idle(30)
        assert engine.is_running and engine.dead_error is None
        assert core.stats["num_requests_aborted"] == 1
        assert not core.has_unfinished_requests() and engine._sinks == {}
        outs = asyncio.run(_collect(engine, "after the cancel", DELTA))
        assert outs[-1].finished
    finally:
        release.set()
        engine.shutdown()

"""vLLM's sleep mode: an idle engine gives the device memory of its KV cache and weights back
(level 1 keeps the weights on the host, level 2 reads them again) and answers as before after
wake_up; requests are refused while it sleeps, and sleep is refused while requests run."""

from __future__ import annotations

import gc

import jax
import pytest
from helpers import make_llm, tiny, tiny_model_dir

from jpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [1, 5, 9]}]
ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
            kv_cache_memory_bytes=2**24, enable_sleep_mode=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_wake_up_answers_as_before(level):
    llm = LLM(model=str(tiny_model_dir()), dtype="float32", **ARGS)
    engine = llm.llm_engine
    want = _tokens(llm)
    before = _live_bytes()
    freed = llm.sleep(level)
    runner = engine.runner
    assert engine.is_sleeping() and engine.loaded.model is None
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(runner.params))
    assert isinstance(runner.kv.k, jax.ShapeDtypeStruct)
    # Nothing holds the pool or the weights on the device any more.
    assert before - _live_bytes() >= freed > 0
    with pytest.raises(ValueError, match="the engine is sleeping"):
        llm.generate(PROMPTS, GREEDY)
    assert engine.get_metrics()["kv_pool_bytes_per_device"] == 0
    llm.wake_up(["weights"])  # half awake: still no request
    with pytest.raises(ValueError, match="the engine is sleeping"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(["kv_cache"])
    assert not engine.is_sleeping() and engine.loaded.model is not None
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == want
    assert out[0].num_cached_tokens == 0  # the device prefix cache went with the pool
    assert llm.sleep(1) > 0 and llm.wake_up() is None and _tokens(llm) == want


def test_sleep_is_refused_with_the_reason():
    off = make_llm(tiny(), **{**ARGS, "enable_sleep_mode": False})
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        off.sleep()
    llm = make_llm(tiny(), **ARGS)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="loaded its model itself"):
        llm.sleep(2)  # a caller's model: the engine cannot read it again
    engine.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="1 requests are unfinished"):
        llm.sleep(1)
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(1)
    assert llm.sleep(1) == 0  # asleep already: a warning, nothing done (vLLM's)
    with pytest.raises(ValueError, match="tags must be among"):
        llm.wake_up(["everything"])
    llm.wake_up()
    assert len(_tokens(llm)) == 2


def test_lora_adapters_survive_sleep(tmp_path):
    """LoRA slots sleep with the weights: after level 2 they come back empty and the
    adapters load again as requests need them; the tokens are the same."""
    from helpers import hf_llama_twin
    from lora_fixtures import write_peft_adapter

    from jpaged import LoRARequest

    path = write_peft_adapter(hf_llama_twin(tiny(), tmp_path / "hf"), tmp_path / "a", r=4,
                              alpha=8, seed=1)
    lora = LoRARequest("a", 1, str(path))
    llm = LLM(model=str(tiny_model_dir()), dtype="float32", enable_lora=True,
              max_lora_rank=8, **ARGS)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)]
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY,
                                                            lora_request=lora)]
        assert got == want, level


def test_core_process_sleeps_too():
    llm = LLM(model=str(tiny_model_dir()), dtype="float32", engine_core_process=True, **ARGS)
    try:
        want = _tokens(llm)
        assert llm.sleep(2) > 0 and llm.llm_engine.is_sleeping()
        with pytest.raises(ValueError, match="the engine is sleeping"):
            llm.generate(PROMPTS, GREEDY)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping() and _tokens(llm) == want
    finally:
        llm.llm_engine.shutdown()


def test_sleep_right_after_a_request_stops_early():
    """Async scheduling: a request that ends by a stop token leaves one step in flight (its
    token past the end is dropped); sleep applies it first instead of refusing."""
    llm = make_llm(tiny(), **ARGS)
    assert llm.llm_engine.config.scheduler.async_scheduling
    first = _tokens(llm)[0]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=20,
                                                   stop_token_ids=[first[2]]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert llm.sleep(1) > 0
    llm.wake_up()
    assert _tokens(llm)[0] == first


def test_the_host_tier_keeps_its_blocks_through_sleep():
    """The device pages go, their copies in the host tier stay: after wake_up the prompt's
    blocks come back from there (prefix hits), with the same tokens."""
    llm = make_llm(tiny(), **{**ARGS, "kv_cache_memory_bytes": None,
                              "num_gpu_blocks_override": 24, "kv_offloading_size": 0.01})
    engine = llm.llm_engine
    want = _tokens(llm)[0]
    fillers = [{"prompt_token_ids": [100 + i] * 60} for i in range(3)]
    llm.generate(fillers, GREEDY)  # push the first prompt's blocks down to the host tier
    held = engine.cached_block_hashes()["CPU"]
    assert held
    llm.sleep(1)
    assert engine.cached_block_hashes()["CPU"] == held
    llm.wake_up()
    out = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert out.outputs[0].token_ids == want and out.num_cached_tokens > 0

"""LoRA adapters in the engine: each request's tokens are HF + peft's greedy tokens for its own
adapter (or the base model), whatever else shares its steps; one device slot serves adapters
in turn; the prefix cache keeps adapters apart; bad adapters are refused by name."""

from __future__ import annotations

import pytest
from helpers import embedded, hf_greedy, hf_llama_twin, make_llm, tiny
from lora_fixtures import peft_model, write_peft_adapter

from jpaged import LLM, SamplingParams
from jpaged.config import EngineArgs
from jpaged.lora_request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1, 5, 9, 23, 44, 12], list(range(3, 30))]  # 6 and 27 tokens
TINY = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=8)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    return hf_llama_twin(tiny(), tmp_path_factory.mktemp("hf-tiny"))


@pytest.fixture(scope="module")
def adapters(hf_tiny, tmp_path_factory) -> dict[str, LoRARequest]:
    """Two adapters: every linear at rank 8, and q/v/down at rank 4 with rsLoRA scaling."""
    root = tmp_path_factory.mktemp("loras")
    a = write_peft_adapter(hf_tiny, root / "a", r=8, alpha=16, seed=1)
    b = write_peft_adapter(hf_tiny, root / "b", r=4, alpha=4, seed=2, use_rslora=True,
                           targets=("q_proj", "v_proj", "down_proj"))
    return {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}


@pytest.fixture(scope="module")
def expected(hf_tiny, adapters) -> dict[str | None, list[list[int]]]:
    """HF + peft greedy tokens of each prompt, per adapter (None: the base model)."""
    out: dict[str | None, list[list[int]]] = {
        None: [hf_greedy(hf_tiny, p, 10, (-1,)) for p in PROMPTS]}
    for name, lora in adapters.items():
        model = peft_model(hf_tiny, lora.lora_path)
        out[name] = [hf_greedy(model, p, 10, (-1,)) for p in PROMPTS]
    assert out["a"] != out[None] and out["b"] != out[None] and out["a"] != out["b"]
    return out


def _run(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * len(loras)
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY,
                                                         lora_request=per_prompt)]


def test_mixed_batch_gives_each_adapters_peft_tokens(adapters, expected):
    llm = make_llm(tiny(), enable_lora=True, max_loras=2, max_lora_rank=8, **TINY)
    got = _run(llm, [None, adapters["a"], adapters["b"]])
    assert got == expected[None] + expected["a"] + expected["b"]
    assert sorted(llm.llm_engine.runner.lora.loaded()) == ["a", "b"]


def test_one_slot_serves_two_adapters_in_turn(adapters, expected):
    """max_loras=1: the scheduler never runs both adapters in one step (the runner refuses a
    step with more adapters than slots), and each still gets its own tokens."""
    llm = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=8, **TINY)
    got = _run(llm, [adapters["a"], None, adapters["b"], adapters["a"]])
    assert got == expected["a"] + expected[None] + expected["b"] + expected["a"]
    assert llm.llm_engine.runner.lora.num_loads >= 2


def test_prefix_cache_keeps_each_adapters_blocks_apart(adapters, expected):
    llm = make_llm(tiny(), enable_lora=True, max_loras=2, max_lora_rank=8,
                   enable_prefix_caching=True, kv_events_config={"enable_kv_cache_events": True},
                   **TINY)
    stored: list[tuple[int | None, int]] = []  # (lora_id, blocks) of each BlockStored event
    llm.llm_engine.subscribe_kv_events(lambda batch: stored.extend(
        (e.lora_id, len(e.block_hashes)) for e in batch.events if type(e).__name__ ==
        "BlockStored"))
    prompt = [{"prompt_token_ids": PROMPTS[1]}]

    def run(lora: LoRARequest | None) -> tuple[list[int], int]:
        out = llm.generate(prompt, GREEDY, lora_request=lora)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    assert run(adapters["a"]) == (expected["a"][1], 0)
    assert run(None) == (expected[None][1], 0)  # never the adapter's KV
    assert run(adapters["b"]) == (expected["b"][1], 0)
    tokens, cached = run(adapters["a"])  # its own blocks: a hit
    assert tokens == expected["a"][1] and cached == 24
    # KV events name each block's adapter (vLLM's lora_id), the base model's none.
    by_lora: dict[int | None, int] = {}
    for lora_id, n in stored:
        by_lora[lora_id] = by_lora.get(lora_id, 0) + n
    assert set(by_lora) == {None, 1, 2} and by_lora[1] == by_lora[None] == by_lora[2]


def test_core_process_runs_adapters(adapters, expected, hf_tiny, tmp_path):
    """The core process reads the adapters again on its side of the pipe; one that no longer
    reads there ends its request with finish reason "error", and the engine serves on."""
    llm = LLM(model=str(_tiny_dir()), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=4, engine_core_process=True,
              kv_cache_memory_bytes=64 * 2**20, **TINY)
    try:
        assert _run(llm, [adapters["b"], None]) == expected["b"] + expected[None]
        gone = write_peft_adapter(hf_tiny, tmp_path / "gone", r=2, alpha=2)
        lora = LoRARequest("gone", 9, str(gone))
        llm.llm_engine.check_lora(lora)  # read by the front end only
        (gone / "adapter_model.safetensors").unlink()
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=lora)[0]
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "adapter_model.safetensors not found" in str(out.outputs[0].stop_reason)
        assert _run(llm, [adapters["a"]]) == expected["a"]
    finally:
        llm.llm_engine.shutdown()


def _tiny_dir():
    from helpers import tiny_model_dir

    return tiny_model_dir()


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(adapters, expected,
                                                                   tmp_path):
    off = make_llm(tiny(), **TINY)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=adapters["a"])
    llm = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=4, **TINY)
    one = [{"prompt_token_ids": PROMPTS[0]}]
    first = llm.generate(one, GREEDY, lora_request=adapters["b"])[0].outputs[0].token_ids
    assert first == expected["b"][0]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        llm.generate(one, GREEDY, lora_request=LoRARequest("x", 3, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="LoRA rank 8 is greater than max_lora_rank 4"):
        llm.generate(one, GREEDY, lora_request=adapters["a"])
    with pytest.raises(ValueError, match="already used for"):
        llm.generate(one, GREEDY, lora_request=LoRARequest("b", 2, adapters["a"].lora_path))
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate(one, GREEDY, lora_request="b")
    with pytest.raises(ValueError, match="got 2 lora_request entries for 1 prompts"):
        llm.generate(one, GREEDY, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("y", 0, "/tmp")
    assert not llm.llm_engine.has_unfinished_requests()
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                       lora_request=adapters["b"])
    assert [o.outputs[0].token_ids for o in got] == expected["b"]


@pytest.mark.parametrize("field, value, match", [
    ("max_loras", 0, "max_loras must be an integer >= 1"),
    ("max_lora_rank", 1024, r"max_lora_rank must be an integer in \[1, 512\]"),
    ("max_cpu_loras", 1, r"max_cpu_loras must be an integer >= max_loras \(2\)"),
])
def test_engine_args_are_checked(field, value, match):
    args = EngineArgs(enable_lora=True, **{"max_loras": 2, field: value})
    with pytest.raises(ValueError, match=match):
        args.create_engine_config(1024)


def test_embedded_model_with_an_adapter_matches_peft(tmp_path):
    """SmolLM2 (the GGUF's q/k permutation undone) with a PEFT adapter on every linear: the
    adapter's request and a base request in the same steps give HF + peft's tokens."""
    loaded = embedded()
    hf = hf_llama_twin(loaded, tmp_path / "hf")
    path = write_peft_adapter(hf, tmp_path / "adapter", r=8, alpha=16, seed=4)
    ids = loaded.tokenizer.encode("The capital of France is")
    want_base = hf_greedy(hf, ids, 12, (-1,))
    want_lora = hf_greedy(peft_model(hf, path), ids, 12, (-1,))
    assert want_lora != want_base
    llm = make_llm(loaded, enable_lora=True, max_lora_rank=8, max_model_len=64,
                   max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, params,
                        lora_request=[LoRARequest("smol", 1, str(path)), None])
    assert [o.outputs[0].token_ids for o in outs] == [want_lora, want_base]


def test_add_remove_list_and_pin_as_vllms_engine(adapters, hf_tiny, tmp_path):
    """vLLM's LLMEngine.add_lora / remove_lora / list_loras / pin_lora on the host copies
    (max_cpu_loras 2: a third adapter drops the least recent unpinned one)."""
    engine = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
                      **TINY).llm_engine
    c = LoRARequest("c", 3, str(write_peft_adapter(hf_tiny, tmp_path / "c", r=2, alpha=2)))
    assert engine.add_lora(adapters["a"]) and engine.add_lora(adapters["b"])
    assert engine.list_loras() == {1, 2}
    assert engine.pin_lora(1)
    with pytest.raises(ValueError, match="lora_int_id 7"):
        engine.pin_lora(7)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'"):
        engine.add_lora(LoRARequest("other", 1, adapters["b"].lora_path))
    engine.add_lora(c)
    assert engine.list_loras() == {1, 3}  # b went, a is pinned
    assert engine.remove_lora(3) and not engine.remove_lora(3)
    assert engine.list_loras() == {1}
    with pytest.raises(FileNotFoundError):
        engine.add_lora(LoRARequest("d", 4, str(tmp_path / "nope")))


def test_metrics_name_the_adapters_in_use(adapters):
    """vLLM's lora_requests_info: the running and waiting requests' adapters as labels."""
    from jpaged.metrics import build_registry, render

    llm = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=8, **TINY)
    engine = llm.llm_engine
    for i, lora in enumerate([adapters["a"], adapters["b"], None]):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[0]}, GREEDY,
                           lora_request=lora)
    engine.step()
    text = render(build_registry(engine.get_metrics))[0].decode()
    line = next(x for x in text.splitlines() if x.startswith("jpaged:lora_requests_info{"))
    assert 'max_lora="1"' in line and 'running_lora_adapters="a"' in line
    assert 'waiting_lora_adapters="b"' in line  # one slot: b waits for a's requests
    engine.abort_request(["r0", "r1", "r2"])


def test_a_rewritten_adapter_read_again_is_a_new_adapter(hf_tiny, tmp_path):
    """A trainer overwrites an adapter's directory; remove_lora, then the same LoRARequest:
    the new weights run (a new device slot, no cached block of the old ones), while a
    request queued before the rewrite keeps the weights it was queued with."""
    path = tmp_path / "x"
    write_peft_adapter(hf_tiny, path, r=4, alpha=8, seed=11)
    old = [hf_greedy(peft_model(hf_tiny, path), PROMPTS[1], 10, (-1,))]
    llm = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=8,
                   enable_prefix_caching=True, **TINY)
    engine, lora = llm.llm_engine, LoRARequest("x", 1, str(path))
    one = [{"prompt_token_ids": PROMPTS[1]}]
    assert [o.outputs[0].token_ids for o in llm.generate(one, GREEDY, lora_request=lora)] == old
    engine.add_request("queued", one[0], GREEDY, lora_request=lora)  # holds the old weights
    import shutil

    shutil.rmtree(path)
    write_peft_adapter(hf_tiny, path, r=4, alpha=8, seed=12)
    new = [hf_greedy(peft_model(hf_tiny, path), PROMPTS[1], 10, (-1,))]
    assert new != old
    assert engine.remove_lora(1)
    engine.add_request("after", one[0], GREEDY, lora_request=lora)  # reads the new files
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [done["queued"].outputs[0].token_ids] == old
    assert [done["after"].outputs[0].token_ids] == new
    assert done["after"].num_cached_tokens == 0  # never the old weights' blocks


def test_queued_requests_keep_their_adapter_when_its_directory_goes(adapters, expected,
                                                                      hf_tiny, tmp_path):
    """max_cpu_loras 1: reading a second adapter drops the first's host copy, and its
    directory is then deleted; the request queued with it still runs it (each request holds
    the adapter it was queued with), and no other request fails."""
    import shutil

    gone = tmp_path / "gone"
    shutil.copytree(adapters["a"].lora_path, gone)
    llm = make_llm(tiny(), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                   **TINY)
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, GREEDY,
                       lora_request=LoRARequest("gone", 5, str(gone)))
    engine.add_request("z", {"prompt_token_ids": PROMPTS[0]}, GREEDY,
                       lora_request=adapters["b"])
    engine.add_request("base", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    shutil.rmtree(gone)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert {k: v.outputs[0].token_ids for k, v in done.items()} == {
        "x": expected["a"][0], "z": expected["b"][0], "base": expected[None][0]}


@pytest.mark.parametrize("kind", ["qwen3_qk_norm", "gemma3"])
def test_other_architectures_give_peft_tokens(kind, tmp_path):
    """Qwen3 (q/k norms after the adapted q/k projections) and Gemma 3 (post norms around
    the adapted projections, sliding layers in their own KV cache group): an adapter's
    request and a base request, each HF + peft's greedy tokens."""
    from tiny_models import make_hf_checkpoint

    hf = make_hf_checkpoint(kind, tmp_path / "model")
    path = write_peft_adapter(hf, tmp_path / "adapter", r=4, alpha=8, seed=3)
    prompt = [1, 5, 9, 23, 44, 12, 7, 8, 9, 10, 11]  # longer than gemma3's window of 4
    want = [hf_greedy(peft_model(hf, path), prompt, 10, (-1,)), hf_greedy(hf, prompt, 10,
                                                                             (-1,))]
    assert want[0] != want[1]
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", enable_lora=True,
              max_lora_rank=8, max_model_len=64, kv_cache_memory_bytes=2**24, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, GREEDY,
                        lora_request=[LoRARequest("a", 1, str(path)), None])
    assert [o.outputs[0].token_ids for o in outs] == want

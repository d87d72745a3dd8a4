"""Tensor-parallel facts measured on 4 forced CPU devices; run by test_tensor_parallel.py.

Run as a script in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the
device count is fixed when jax starts, so the rest of the suite keeps one device). Prints one
JSON object on the last line of stdout; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The repo root first: tests/jpaged would otherwise shadow the jpaged package.
sys.path[:0] = [str(ROOT)]
sys.path += [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JPAGED_TEST_JAX_CACHE", str(ROOT / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from flax import nnx  # noqa: E402
from helpers import embedded, make_llm, tiny  # noqa: E402

from jpaged import LLM, SamplingParams  # noqa: E402
from jpaged.runner.batch import empty_step, flatten_step  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=7, max_tokens=8)
# The top-5 candidates' logprobs (a top-k over the (vocab-split) logits) of each new token,
# and every prompt token's logprob and its 5 best candidates (an extra program of the step):
# one request asks for both, so one program variant per step shape serves the two.
TOP5 = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=5)
# Penalties, a logit bias and an allowed set: scatters into the (vocab-split) logits.
SHAPED = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.5,
                        frequency_penalty=0.5, logit_bias={7: 5.0, 299: 3.0, 150: -100.0},
                        allowed_token_ids=list(range(0, 300, 3)) + [7, 299])
TINY_PROMPTS = ["Hello there", "abc", "The quick brown fox jumps"]  # 11, 3, 25 byte tokens
TINY_ARGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                 num_gpu_blocks_override=24)
EMBEDDED_ARGS = dict(max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16,
                     num_gpu_blocks_override=8)
COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|all-to-all|reduce-scatter|"
                        r"collective-permute)(?:-start)?\(")


def kv_facts(llm) -> dict:
    """Global pool shape, each device's shard shape and bytes, and the engine's metrics."""
    kv = llm.llm_engine.runner.kv
    metrics = llm.llm_engine.get_metrics()
    return {
        "global_shape": list(kv.k.shape),
        "shard_shapes": [list(s.data.shape) for s in kv.k.addressable_shards],
        "shard_devices": sorted(s.device.id for s in kv.k.addressable_shards),
        "k_bytes_global": int(kv.k.nbytes),
        "k_bytes_shard": int(kv.k.addressable_shards[0].data.nbytes),
        "tensor_parallel_size": metrics["tensor_parallel_size"],
        "kv_pool_bytes_per_device": metrics["kv_pool_bytes_per_device"],
    }


def collectives(llm, t: int, b: int, plp: int = 0, top: bool = False) -> dict:
    """Collective ops in the compiled (partitioned) step of one bucket shape (with `plp` rows
    of prompt logprobs; `top`: the variant that returns top candidates)."""
    r = llm.llm_engine.runner
    packed = empty_step(r.plan, t, b, r.vocab_size)
    if plp:
        rows = np.zeros(plp, np.int32)
        packed = replace(packed, batch=replace(packed.batch, plp_idx=rows, plp_target=rows))
    text = r._jit_step.lower(r.params, r.kv, flatten_step(packed.batch), r._buffer(),
                             flags=replace(packed.flags, top_logprobs=top)).compile().as_text()
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            found.setdefault(m.group(1), []).append(line.split("=")[1].split()[0])  # result type
    return found


def tiny_cases(out: dict) -> None:
    """tp 1, 2, 4 on the 4-query/2-KV-head tiny Llama; tp 4 replicates each KV head twice."""
    for tp in (1, 2, 4):
        t0 = time.perf_counter()
        llm = make_llm(tiny(), tensor_parallel_size=tp, **TINY_ARGS)
        runner = llm.llm_engine.runner
        case: dict = {}
        if tp == 4:  # warm every bucket shape, then a workload must compile nothing
            case["warmup_compiled"] = runner.warmup()
            case["bucket_shapes"] = len(runner.plan.all_shapes())
        case["tokens"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]
        case["tokens_again"] = [o.outputs[0].token_ids
                                for o in llm.generate(TINY_PROMPTS[::-1], GREEDY)][::-1]
        case["compiled"] = runner.num_compiled
        # Seeded draws with top-p/top-k filtering, from logits left vocab-split under tp (after
        # the count above: penalties and biases are new programs).
        case["sampled"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, SAMPLED)]
        case["shaped"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, SHAPED)]
        top5 = llm.generate(TINY_PROMPTS, TOP5)
        case["top5"] = [[sorted((k, v.logprob) for k, v in step.items())
                         for step in o.outputs[0].logprobs] for o in top5]
        case["prompt5"] = [[sorted((k, v.logprob) for k, v in pos.items())
                            for pos in o.prompt_logprobs[1:]] for o in top5]
        case["kv"] = kv_facts(llm)
        if tp > 1:
            case["collectives"] = collectives(llm, 16, 4)
            case["collectives_prompt_logprobs"] = collectives(llm, 16, 4, plp=8)
            case["collectives_top"] = collectives(llm, 16, 4, top=True)
        case["seconds"] = round(time.perf_counter() - t0, 1)
        out[f"tiny_tp{tp}"] = case


def fused_linear_cases(out: dict) -> None:
    """The Pallas backend's fused decode projections under tp 2 and 4 (interpreter), on a
    tiny Llama whose shapes they take: head_dim 32 (RoPE in the q/k/v kernel's epilogue),
    biases on q/k/v and o (split and replicated), 4 query / 2 KV heads (tp 4 replicates each
    KV head). Greedy tokens beside the XLA backend's at tp 1."""
    import tempfile

    from tiny_models import random_weights, tiny_spec, write_hf_dir

    from models.loader import load_model

    spec = tiny_spec(head_dim=32, intermediate_size=128, attention_bias=True, o_proj_bias=True,
                     max_position_embeddings=512)
    path = write_hf_dir(Path(tempfile.mkdtemp(prefix="jpaged-fused-")) / "m", spec,
                        random_weights(spec, seed=3))
    loaded = load_model(str(path), dtype="float32")
    case: dict = {"xla": [o.outputs[0].token_ids
                          for o in make_llm(loaded, **TINY_ARGS).generate(TINY_PROMPTS, GREEDY)]}
    for tp in (2, 4):  # (tp 1: tests/jpaged/test_engine_pallas.py, tests/models)
        llm = make_llm(loaded, tensor_parallel_size=tp, attention_backend="pallas", **TINY_ARGS)
        lin = llm.llm_engine.runner.linears
        case[f"linears_tp{tp}"] = None if lin is None else lin.name
        case[f"tp{tp}"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]
    out["fused_linears"] = case


def quantized_cases(out: dict) -> None:
    """A GGUF at its own quantization (Q4_1 / Q8_0 linears, a Q8_0 embedding and head) at tp
    1 and 2: the quantized arrays split as the float kernels do (columns; o/down by rows, at
    group boundaries), the same greedy tokens; a split that would cut a group is refused."""
    import tempfile

    from tiny_models import random_weights, tiny_spec, write_gguf

    from models.loader import load_model

    types = {"q_proj": "Q4_1", "k_proj": "Q8_0", "v_proj": "Q4_1", "o_proj": "Q4_1",
             "gate_proj": "Q4_1", "up_proj": "Q8_0", "down_proj": "Q4_1",
             "embed_tokens": "Q8_0", "lm_head": "Q8_0"}
    tmp = Path(tempfile.mkdtemp(prefix="jpaged-qtp-"))
    spec = tiny_spec(intermediate_size=128)
    path = write_gguf(tmp / "q.gguf", spec, random_weights(spec, seed=5), quantize=types)
    case: dict = {}
    for tp in (1, 2):
        loaded = load_model(str(path), "float32", tensor_parallel_size=tp, quantization="gguf")
        llm = make_llm(loaded, tensor_parallel_size=tp, **TINY_ARGS)
        case[f"tp{tp}"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]
        layer = llm.llm_engine.loaded.model.model.layers
        state = nnx.state(layer)
        for name in ("q_proj", "down_proj"):
            leaf = next(x for p, x in jax.tree_util.tree_leaves_with_path(state)
                        if name in jax.tree_util.keystr(p) and "qweight" in jax.tree_util.keystr(p))
            case[f"{name}_tp{tp}"] = [list(leaf.shape),
                                      [list(s.data.shape) for s in leaf.addressable_shards]]
    for tp in (1, 2):  # fp8 per channel: o/down split by rows, their one scale row replicated
        loaded = load_model(str(path), "float32", tensor_parallel_size=tp, quantization="fp8")
        llm = make_llm(loaded, tensor_parallel_size=tp, **TINY_ARGS)
        case[f"fp8_tp{tp}"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]
    odd = tiny_spec()  # intermediate 96: down_proj's 96 rows split 2 ways cut groups of 32
    bad = write_gguf(tmp / "odd.gguf", odd, random_weights(odd), quantize={"down_proj": "Q4_1"})
    try:
        load_model(str(bad), "float32", tensor_parallel_size=2, quantization="gguf")
        case["cut_error"] = None
    except ValueError as e:
        case["cut_error"] = str(e)
    out["quantized"] = case


def candidate_cases(out: dict) -> None:
    """The sampler's candidate path on vocab-split logits (`TensorParallel.candidates`, runs
    of 8, 4 kept): the tokens each row draws at tp 1, 2 and 4, and with the whole-row path,
    on 1,024-token rows with every filter mix, a mask and a flat row; and which rows the
    candidates settled."""
    from tiny_models import tiny_spec

    from jpaged.runner.parallel import TensorParallel
    from jpaged.runner.sampler import (
        SamplingBatch,
        SamplingFlags,
        _candidate_draw,
        row_keys,
        sample,
    )

    rng = np.random.default_rng(3)
    b, v = 6, 1024
    x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    x[1, 300:] = -np.inf  # a mask
    x[4] = 0.0  # flat: the whole row settles it
    sb = SamplingBatch(
        temperature=np.array([1.0, 0.8, 1.0, 1.3, 1.0, 0.0], np.float32),
        top_k=np.array([3, 4, v, 2, 4, 4], np.int32),
        top_p=np.array([1.0, 0.9, 0.5, 0.95, 1.0, 1.0], np.float32),
        min_p=np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.0], np.float32),
        seeds=np.arange(b, dtype=np.uint32), counters=np.zeros(b, np.int32),
        repetition_penalty=np.ones(b, np.float32), presence_penalty=np.zeros(b, np.float32),
        frequency_penalty=np.zeros(b, np.float32), history=np.zeros((b, 0), np.int32),
        history_is_output=np.zeros((b, 0), bool))
    for tp in (1, 2, 4):
        par = TensorParallel(tiny_spec(vocab_size=v), tp)
        logits = par.split_logits(jax.device_put(x))
        runs = {}
        for name, cand in (("candidates", (8, 4)), ("whole_row", (0, 0))):
            fn = jax.jit(partial(sample, flags=SamplingFlags(), top_k=par.top_k,
                                 keep_split=par.split_logits,
                                 vocab_shards=tp if par.split_vocab else 1, wide_search=True,
                                 candidates=cand, pick_candidates=par.candidates))
            draws = []
            for c in range(6):
                sb.counters = np.full(b, c, np.int32)
                draws.append(np.asarray(fn(logits, sb)[0]).tolist())
            runs[name] = draws
        temp = np.where(sb.temperature > 0, sb.temperature, 1.0).astype(np.float32)
        keys = row_keys(sb)
        _, exact = jax.jit(partial(_candidate_draw, chunk=8, keep=4, pick=par.candidates,
                                   shards=tp if par.split_vocab else 1,
                                   keep_split=par.split_logits))(
            logits, temp, sb, sb.temperature > 0, keys)
        runs["settled"] = np.asarray(exact).tolist()
        out[f"candidates_tp{tp}"] = runs


def embedded_cases(out: dict) -> None:
    """SmolLM2 (9 query / 3 KV heads): tp 3 equals tp 1; tp 2 and tp 8 are refused clearly."""
    loaded = embedded()
    params = SamplingParams(temperature=0.0, max_tokens=6)
    for tp in (1, 3):
        t0 = time.perf_counter()
        llm = make_llm(loaded, tensor_parallel_size=tp, **EMBEDDED_ARGS)
        o = llm.generate(["The capital of France is"], params)[0].outputs[0]
        out[f"embedded_tp{tp}"] = {"tokens": o.token_ids, "text": o.text, "kv": kv_facts(llm),
                                   "seconds": round(time.perf_counter() - t0, 1)}
    for tp in (2, 8):
        try:
            make_llm(loaded, tensor_parallel_size=tp, **EMBEDDED_ARGS)
            out[f"embedded_tp{tp}_error"] = None
        except ValueError as e:
            out[f"embedded_tp{tp}_error"] = str(e)


def default_pool_cases(out: dict) -> None:
    """The CPU default KV space (2 GiB) at tp 1 and 2: the forced devices share the machine's
    RAM, so tp 2 takes the same total pool (each device half), not twice it."""
    import gc

    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine

    for tp in (1, 2):  # no sizing argument: the default (make_llm would fix 256 MiB a device)
        llm = LLMEngine(EngineArgs(tensor_parallel_size=tp, max_model_len=64, max_num_seqs=4,
                                   max_num_batched_tokens=16, block_size=8), loaded=tiny())
        m = llm.get_metrics()
        out[f"default_pool_tp{tp}"] = {"num_gpu_blocks": m["num_gpu_blocks"],
                                       "bytes_per_device": m["kv_pool_bytes_per_device"]}
        del llm, m
        gc.collect()


def device_bytes(device) -> int:
    """Bytes of every live array's shards on `device`."""
    return sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards
               if s.device == device)


def sharded_load_cases(out: dict) -> None:
    """A 2-file safetensors model (6 query / 3 KV heads) loaded at tp 3 by the engine itself:
    each device receives its share of the parameters and nothing whole lands on device 0.
    Runs first, so device 0 holds nothing else yet."""
    import tempfile

    from tiny_models import random_weights, tiny_spec, write_hf_dir

    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine
    from jpaged.runner.parallel import AXIS, kv_bytes_per_device

    spec = tiny_spec(hidden_size=96, num_heads=6, num_kv_heads=3, intermediate_size=96)
    path = write_hf_dir(Path(tempfile.mkdtemp(prefix="jpaged-tp3-")) / "m", spec,
                        random_weights(spec, seed=3), shards=2)
    dev0 = jax.devices()[0]
    args = dict(model=str(path), dtype="float32", kv_cache_memory_bytes=2**20, **{
        k: v for k, v in TINY_ARGS.items() if k != "num_gpu_blocks_override"})
    before = device_bytes(dev0)
    engine = LLMEngine(EngineArgs(tensor_parallel_size=3, **args))
    grown = device_bytes(dev0) - before
    runner = engine.runner
    leaves = []
    for p, x in jax.tree_util.tree_leaves_with_path(runner.params):
        split = AXIS in tuple(x.sharding.spec)
        leaves.append({"name": jax.tree_util.keystr(p), "bytes": int(x.nbytes), "split": split,
                       "shard_bytes": [int(s.data.nbytes) for s in x.addressable_shards],
                       "devices": sorted(s.device.id for s in x.addressable_shards)})
    loaded = jax.tree_util.tree_leaves(nnx.state(engine.loaded.model))
    ran = jax.tree_util.tree_leaves(runner.params)
    three = LLM.from_engine(engine).generate(TINY_PROMPTS, GREEDY)
    one = LLM.from_engine(LLMEngine(EngineArgs(**args))).generate(TINY_PROMPTS, GREEDY)
    out["sharded_load"] = {
        "index_files": sorted(f.name for f in path.glob("*.safetensors")),
        "leaves": leaves, "device0_grown": grown,
        "kv_bytes_per_device": kv_bytes_per_device(runner.kv),
        "runner_uses_loaded_arrays": all(a is b for a, b in zip(loaded, ran, strict=True)),
        "tokens_tp3": [o.outputs[0].token_ids for o in three],
        "tokens_tp1": [o.outputs[0].token_ids for o in one],
    }


def lora_cases(out: dict) -> None:
    """A LoRA adapter beside the base model at tp 1 and 2: the slots replicated, the same
    tokens (the adapter's product lies on the split projections' outputs and inputs)."""
    import tempfile

    from helpers import hf_llama_twin
    from lora_fixtures import write_peft_adapter

    from jpaged.lora_request import LoRARequest

    tmp = Path(tempfile.mkdtemp(prefix="jpaged-tp-lora-"))
    path = write_peft_adapter(hf_llama_twin(tiny(), tmp / "hf"), tmp / "a", r=4, alpha=8,
                              seed=2)
    lora = LoRARequest("a", 1, str(path))
    case: dict = {}
    for tp in (1, 2):
        llm = make_llm(tiny(), tensor_parallel_size=tp, enable_lora=True, max_lora_rank=4,
                       **TINY_ARGS)
        outs = llm.generate(TINY_PROMPTS * 2, GREEDY,
                            lora_request=[None] * len(TINY_PROMPTS) + [lora] * len(TINY_PROMPTS))
        case[f"tp{tp}"] = [o.outputs[0].token_ids for o in outs]
        if tp == 2:
            a, b = llm.llm_engine.runner.lora.weights["q_proj"]
            case["slot_sharding"] = [str(a.sharding.spec), str(b.sharding.spec)]
    out["lora"] = case


def moe_cases(out: dict) -> None:
    """A Qwen2-MoE (experts and a gated shared expert) at tp 1 and 2: the same tokens, each
    device holding half of every expert's width, the router replicated."""
    from jpaged.bench.fixtures import random_model
    from models.config import ModelSpec

    spec = ModelSpec.from_hf_config({
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "num_experts": 6,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "bos_token_id": 256, "eos_token_id": 257})
    case: dict = {}
    for tp in (1, 2):
        llm = make_llm(random_model(spec, np.float32, seed=4), tensor_parallel_size=tp,
                       **TINY_ARGS)
        outs = llm.generate(TINY_PROMPTS, GREEDY)
        case[f"tp{tp}"] = [o.outputs[0].token_ids for o in outs]
        if tp == 2:
            moe = llm.llm_engine.runner.params["model"]["layers"][0]["mlp"]  # never scanned
            case["shard_shapes"] = {
                name: list(arr.addressable_shards[0].data.shape) for name, arr in (
                    ("gate_proj", moe["experts"]["gate_proj"]),
                    ("down_proj", moe["experts"]["down_proj"]),
                    ("router", moe["gate"]["kernel"]))}
    # The GPU's way under tensor parallel: the kernel (interpreted here) on each device's
    # width under shard_map, its partial down products summed; against one device's loop.
    from flax import nnx
    from tiny_models import flatten, make_logits_fn

    from jpaged.runner.parallel import TensorParallel
    from models.moe import experts_run_as

    model = random_model(spec, np.float32, seed=4).model
    ids, pos, seg = flatten([[256, 7, 99, 12, 150, 3], [256, 1, 2]], pad_to=12)
    with experts_run_as("loop"):
        want = np.asarray(make_logits_fn(model)(ids, pos, seg))
    tp = TensorParallel(spec, 2, jax.devices()[:2])
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, tp.shard_params(state))
    with experts_run_as("interpret", tp.mesh):
        got = np.asarray(make_logits_fn(sharded)(ids, pos, seg))
    case["kernel_tp2_max_err"] = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
    # Quantized experts placed straight into their split by the loader (fp8 at load; a GGUF's
    # int4 / int8 groups at its own quantization): the kernel per device (values, scales and
    # mins split as the float experts) gives one device's logits; the GGUF's engine at tp 2
    # gives tp 1's tokens (the engine is run for one quantized kind only: a pair of engines
    # costs a tenth of the suite's tensor-parallel time, and fp8's placement and per-device
    # products are what differ, checked here).
    import tempfile

    from tiny_models import MOE_GGUF_TYPES, make_hf_checkpoint, write_moe_gguf

    from models import load_model

    path = Path(tempfile.mkdtemp(prefix="jpaged-tp-moe-"))
    make_hf_checkpoint("qwen2_moe_even", path / "hf")
    spec = load_model(str(path / "hf"), dtype="float32").spec
    gguf = write_moe_gguf(path / "moe.gguf", path / "hf", spec, "qwen2moe", MOE_GGUF_TYPES)
    for label, source, quantization in (("fp8", path / "hf", "fp8"), ("gguf", gguf, "gguf")):
        for tp in (1, 2):
            loaded = load_model(str(source), dtype="float32", tensor_parallel_size=tp,
                                quantization=quantization)
            if label == "gguf":
                llm = make_llm(loaded, tensor_parallel_size=tp, **TINY_ARGS)
                case[f"{label}_tp{tp}"] = [o.outputs[0].token_ids
                                           for o in llm.generate(TINY_PROMPTS, GREEDY)]
            if tp == 1:
                with experts_run_as("loop"):
                    want = np.asarray(make_logits_fn(loaded.model)(ids, pos, seg))
                continue
            experts = loaded.model.model.layers[0].mlp.experts
            case[f"{label}_shards"] = [
                list(a.addressable_shards[0].data.shape) for w in (experts.gate_proj,
                                                                   experts.down_proj)
                for a in (w.qweight[...], w.scales[...])]
            tp_layout = TensorParallel(loaded.spec, 2, jax.devices()[:2])
            with experts_run_as("interpret", tp_layout.mesh):
                got = np.asarray(make_logits_fn(loaded.model)(ids, pos, seg))
            case[f"{label}_kernel_tp2_max_err"] = float(np.abs(got - want).max()
                                                        / max(1.0, np.abs(want).max()))
    out["moe"] = case


def pooling_cases(out: dict) -> None:
    """An embedding engine (runner "pooling", MEAN) at tp 1 and 2: each prompt's vector, its
    hidden states pooled on the mesh (replicated) as on one device."""
    case: dict = {}
    for tp in (1, 2):
        llm = make_llm(tiny(), runner="pooling", pooler_config={"pooling_type": "MEAN"},
                       tensor_parallel_size=tp, **TINY_ARGS)
        case[f"tp{tp}"] = [o.outputs.embedding for o in llm.embed(TINY_PROMPTS)]
    # A sequence classifier (three labels): its score head replicated beside the split layers.
    import tempfile

    from tiny_models import make_hf_classifier

    from models import load_model
    with tempfile.TemporaryDirectory() as tmp:
        make_hf_classifier("llama_tied", Path(tmp), ["a", "b", "c"], seed=5)
        loaded = load_model(tmp, dtype="float32")
        for tp in (1, 2):
            llm = make_llm(loaded, runner="pooling", tensor_parallel_size=tp, **TINY_ARGS)
            case[f"classify_tp{tp}"] = [o.outputs.probs for o in llm.classify(TINY_PROMPTS)]
    out["pooling"] = case


# The cases of each test file's subprocess (argv[1]): two files, so pytest's two workers run
# them side by side.
GROUPS = {
    "engine": (sharded_load_cases, tiny_cases, candidate_cases, embedded_cases,
               default_pool_cases),
    "kernels": (fused_linear_cases, quantized_cases, lora_cases, moe_cases, pooling_cases),
}


def main() -> None:
    """Run one group's cases (argv[1], default "engine") and print the facts as JSON."""
    group = sys.argv[1] if len(sys.argv) > 1 else "engine"
    out: dict = {"num_devices": jax.device_count()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in GROUPS[group]:
            case(out)
    out["warnings"] = [str(w.message)[:200] for w in caught]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

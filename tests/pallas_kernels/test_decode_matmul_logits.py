"""The output head (logits) on the weight-streaming kernel (`decode_matmul.logits`), in
interpret mode: against the models' XLA heads for float lm_head [K, V] kernels, tied [V, K]
tables, int4 / int8 / fp8 lm_heads (QuantLinear.product) and int4 / int8 tables
(QuantEmbed.attend); vocabularies the tile does not divide (the last block masked, nothing
read past V); the plans and the Triton lowering for real vocabularies; the runner's choice;
tensor parallel over two CPU devices; and greedy tokens through the engine with the head on
the kernel equal to XLA's (the tiny random model, tied and not, and the embedded SmolLM2 at
its own quantization, whose tied head is a Q8_0 table)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import lower_for_cuda, make_llm, run_on_cpu_devices, tiny
from test_decode_matmul_quant import qweight
from tiny_models import random_weights, tiny_spec, write_hf_dir

from jpaged.runner.linears import kernel_linears, select_linears
from jpaged.sampling_params import SamplingParams
from models.loader import load_model
from models.quant import QuantWeight, pack_int4
from models.quant_layers import QuantEmbed, QuantLayout, QuantLinear
from models.registry import get_model_class
from pallas_kernels import decode_matmul as dm

ROOT = Path(__file__).resolve().parents[2]
S = jax.ShapeDtypeStruct


def _close(got: jax.Array, want: jax.Array, dtype: jnp.dtype) -> None:
    # float32 sums of the same products in another order; bf16 operands are the same bf16
    # values on both sides, so only the summation order differs there too.
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


def _model(spec, dtype):
    """A model of `spec` with random weights (O(1) logits)."""
    model = get_model_class(spec.architecture)(spec, dtype=dtype, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    new = [(jax.random.normal(key, x.shape) / 4).astype(x.dtype)
           for key, x in zip(keys, leaves, strict=True)]
    return nnx.merge(graph, jax.tree.unflatten(tree, new))


# (tied, vocab, rows, dtype, extra spec): 300 is no multiple of any tile >= 8 (block_n 128,
# halved to 32 for few programs: a last block of 12 columns); 512 divides into 32-column blocks.
FLOAT_CASES = [
    (False, 300, 1, jnp.float32, {}),
    (True, 300, 3, jnp.float32, {}),
    (False, 512, 17, jnp.bfloat16, {}),
    (True, 300, 1, jnp.bfloat16, {}),
    (True, 300, 5, jnp.float32, {"architecture": "Gemma2ForCausalLM",
                                 "hidden_act": "gelu_pytorch_tanh",
                                 "final_logit_softcapping": 5.0}),
]


@pytest.mark.parametrize("tied,vocab,rows,dtype,extra", FLOAT_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_the_head_kernel_computes_the_xla_head(tied, vocab, rows, dtype, extra):
    """compute_logits given the kernels' linears equals its XLA head: lm_head [K, V] and tied
    [V, K] tables, float32 and bf16, a ragged vocabulary, Gemma 2's soft-cap after."""
    spec = tiny_spec(vocab_size=vocab, tie_word_embeddings=tied, **extra)
    model = _model(spec, dtype)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (rows, spec.hidden_size)).astype(dtype)
    want = model.compute_logits(hidden)
    got = model.compute_logits(hidden, linears=kernel_linears(interpret=True))
    _close(got, want, dtype)
    if extra:  # the soft-cap applies after the kernel: |logits| < cap
        assert float(jnp.max(jnp.abs(got))) < 5.0


def qtable(kind: str, vocab: int, k: int, group: int, seed: int) -> QuantWeight:
    """A random [vocab, k] table quantized along k (QuantEmbed's layout, k_axis 1)."""
    rng = np.random.default_rng(seed)
    groups = k // group
    step = 1 / np.sqrt(k) / (4 if kind == "int4" else 64)
    scales = (rng.uniform(0.5, 1.5, (vocab, groups)) * step).astype(np.float16)
    if kind == "int4":
        vals = rng.integers(0, 16, (vocab, k), dtype=np.uint8)
        low = (-7.5 * scales.astype(np.float32)).astype(np.float16)
        w = QuantWeight("int4", pack_int4(vals, group, k_axis=1), scales, low, 1)
    else:
        w = QuantWeight("int8", rng.integers(-128, 128, (vocab, k), dtype=np.int8), scales,
                        None, 1)
    w.check("test table")
    return jax.tree.map(jnp.asarray, w)


def _quant_module(w: QuantWeight, dtype: jnp.dtype) -> QuantLinear | QuantEmbed:
    """A QuantLinear (a [K, V] weight) or QuantEmbed (a [V, K] table) holding `w`."""
    layout = QuantLayout(w.kind, w.group_size, w.mins is not None,
                         jnp.dtype(w.scales.dtype).name)
    if w.k_axis == 0:
        m = QuantLinear(w.k, int(w.q.shape[1]), layout, False, dtype)
    else:
        m = QuantEmbed(int(w.q.shape[0]), w.k, layout, dtype)
    m.qweight.set_value(w.q)
    m.scales.set_value(w.scales)
    if w.mins is not None:
        m.mins.set_value(w.mins)
    return m


# (kind, group (0: per channel), table, rows, dtype): GGUF's Q8_0 / Q4_1 tables (tied heads),
# Q6_K-like int8 groups of 16, GPTQ-like int4, fp8 per channel; vocab 300 (ragged).
QUANT_CASES = [
    ("int8", 32, True, 1, jnp.bfloat16),
    ("int4", 32, True, 3, jnp.float32),
    ("int8", 16, False, 3, jnp.bfloat16),
    ("int8", 0, False, 1, jnp.float32),
    ("int4", 32, False, 17, jnp.bfloat16),
    ("fp8", 0, False, 3, jnp.float32),
]


@pytest.mark.parametrize("kind,group,table,rows,dtype", QUANT_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_the_head_kernel_computes_the_quantized_xla_heads(kind, group, table, rows, dtype):
    """A quantized lm_head (QuantLinear.product) or tied table (QuantEmbed.attend): the kernel
    reads the packed bytes and gives XLA's float32 logits."""
    k, vocab = 128, 300
    if table:
        w = qtable(kind, vocab, k, group, seed=3)
    else:
        w = qweight(kind, k, vocab, group or k, True, seed=3)
    module = _quant_module(w, dtype)
    hidden = jax.random.normal(jax.random.PRNGKey(4), (rows, k)).astype(dtype)
    want = module.attend(hidden) if table else module.product(hidden)
    got = kernel_linears(interpret=True).logits(hidden, module.weight(), transposed=table)
    _close(got, want, dtype)


def _loads(fn, *args) -> list[str]:
    """Every read (`<-`) of the kernel jaxpr(s) `fn` traces, as its text line."""
    text = str(jax.make_jaxpr(fn)(*args))  # a load: `v:bf16[64,32] <- ref[...] [mask=m]`
    return [line for line in text.splitlines() if re.match(r"\s*\w+:\S+ <- \w+\[", line)]


@pytest.mark.parametrize("what", ["float", "float_t", "int4_t", "fp8"])
def test_a_ragged_head_reads_nothing_past_the_vocabulary(what):
    """Every load of a launch whose last column block overhangs the vocabulary is masked (on
    a GPU an unmasked one would read past the weight); a vocabulary the tile divides loads
    its weight tiles unmasked (the launch traces as before)."""
    k = 64
    x = jnp.zeros((1, k), jnp.bfloat16)

    def weight(vocab: int):
        if what == "float":
            return jnp.zeros((k, vocab), jnp.bfloat16), False
        if what == "float_t":
            return jnp.zeros((vocab, k), jnp.bfloat16), True
        if what == "int4_t":
            return qtable("int4", vocab, k, 32, seed=0), True
        return qweight("fp8", k, vocab, k, False, seed=0), False

    for vocab, ragged in ((300, True), (512, False)):
        w, tr = weight(vocab)
        loads = _loads(lambda x, w, tr=tr: dm.logits(x, w, transposed=tr), x, w)
        assert loads
        masked = [ln for ln in loads if "mask=" in ln]
        assert (masked == loads) == ragged, "\n".join(loads)


@pytest.mark.parametrize("vocab", [49152, 128256, 151936, 262144, 32064, 50257])
def test_plans_for_real_vocabularies(vocab):
    """Every real vocabulary (none a power of two) gets 128 columns a program at batch 1 and
    64, with enough programs to fill an H200; one with no power-of-two factor >= 32 keeps
    128-column blocks and masks its last (e.g. GPT-2's 50257)."""
    for rows in (1, 64):
        plan = dm.plan_stream(rows, 4096, [vocab], 2, ragged=True)
        assert plan.block_n == (64 if vocab == 32064 else 128)
        assert -(-vocab // plan.block_n) >= 264
        assert plan.block_k * plan.block_n * 2 <= 16 * 1024
        if vocab % 32 == 0:
            assert vocab % plan.block_n == 0  # no masked block where a tile divides
    int8 = dm.QuantFormat("int8", 32, False)  # SmolLM2's Q8_0 tied table: K = 576
    plan = dm.plan_stream(1, 576, [49152], 2, ragged=True, formats=[int8])
    assert (plan.block_n, plan.block_k) == (128, 32)  # 32-byte rows of values: 16-byte loads


def _triton_calls(text: str) -> int:
    return text.count("xla.gpu.triton") + text.count("triton_kernel_call")


def test_the_head_lowers_to_one_triton_call():
    """Llama-3-8B's lm_head at batch 1 and 64, SmolLM2's Q8_0 tied table, and ragged float and
    int4 heads: one Triton kernel each (Pallas -> Triton IR, no GPU needed)."""
    bf16 = jnp.bfloat16
    cases = [(1, S((4096, 128256), bf16), False), (64, S((4096, 128256), bf16), False),
             (1, S((49152, 576), bf16), True),
             (1, QuantWeight("int8", S((49152, 576), jnp.int8), S((49152, 18), jnp.float16),
                             None, 1), True),
             (3, S((64, 300), bf16), False),
             (3, QuantWeight("int4", S((300, 32), jnp.uint8), S((300, 2), jnp.float16),
                             S((300, 2), jnp.float16), 1), True)]
    for rows, w, tr in cases:
        k = w.k if isinstance(w, QuantWeight) else w.shape[1 if tr else 0]
        text = lower_for_cuda(lambda x, w, tr=tr: dm.logits(x, w, transposed=tr),
                              S((rows, k), bf16), w)
        assert _triton_calls(text) == 1 and "decode_matmul_logits" in text


def test_the_runner_puts_the_head_on_the_kernel_where_it_can(caplog):
    spec = tiny_spec(head_dim=32, intermediate_size=128)
    tied = spec.replace(tie_word_embeddings=True)
    q8 = {"model.embed_tokens": QuantLayout("int8", 32, False, "float16")}
    fp8_head = {"lm_head": QuantLayout("fp8", spec.hidden_size, False, "float32")}
    # A float (or fp8) head up to 64 rows; an integer one up to 256 (XLA's path would
    # dequantize the whole head into a temporary of the weight's size).
    for s, plan, tp, rows in ((spec, {}, 1, 64), (tied, {}, 1, 64), (tied, q8, 1, 256),
                              (spec, fp8_head, 1, 64), (spec, {}, 2, 64), (tied, {}, 2, 64)):
        lin = select_linears("pallas", "gpu", s, jnp.bfloat16, tp, plan)
        assert lin.logits is not None and lin.logits_max_rows == rows
    fp8_table = {"model.embed_tokens": QuantLayout("fp8", spec.hidden_size, False, "float32")}
    for s, plan, tp, why in (
            (tied, fp8_table, 1, "a fp8 embedding table"),
            (tied, q8, 2, "a quantized head is replicated under tensor_parallel_size=2"),
            (spec.replace(vocab_size=301), {}, 2, "vocabulary 301 is replicated")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jpaged.runner"):
            lin = select_linears("pallas", "gpu", s, jnp.bfloat16, tp, plan)
        assert lin is not None and lin.logits is None  # the projections keep their kernels
        assert f"the output head stays on XLA's GEMM: {why}" in caplog.text


def test_the_head_under_tensor_parallel():
    """TensorParallel.wrap_linears over two CPU devices (a subprocess): each device runs the
    kernel on its vocabulary shard (lm_head's columns, the tied table's rows; 150 columns a
    device: a ragged block) and the vocab-split logits equal the one-device kernel's."""
    run_on_cpu_devices(_TP_SCRIPT, 2, ROOT)


_TP_SCRIPT = """
import sys
sys.path[:0] = ["tests/models", "."]
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tiny_models import tiny_spec
from jpaged.runner.linears import kernel_linears
from jpaged.runner.parallel import TensorParallel
from models.sharding import AXIS

spec = tiny_spec(head_dim=32, intermediate_size=128)  # vocab 300
tp = TensorParallel(spec, 2)
one = kernel_linears(interpret=True)
both = tp.wrap_linears(one)
h = jax.random.normal(jax.random.PRNGKey(0), (3, spec.hidden_size), jnp.float32)
w = jax.random.normal(jax.random.PRNGKey(1), (spec.hidden_size, spec.vocab_size), jnp.float32)
for tr, weight, split in ((False, w, P(None, AXIS)), (True, w.T, P(AXIS, None))):
    want = one.logits(h, weight, transposed=tr)
    sharded = jax.device_put(weight, NamedSharding(tp.mesh, split))
    got = both.logits(h, sharded, transposed=tr)
    assert got.sharding.spec == P(None, AXIS), got.sharding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    print(tr, "ok")
print("tp ok")
"""


def _greedy_with_head_count(llm, prompts, max_tokens: int) -> tuple[list, int]:
    """Greedy tokens, and how many programs traced the head kernel (the runner's linears
    wrapped to count their `logits` calls)."""
    runner = llm.llm_engine.runner
    calls = [0]
    inner = runner.linears.logits

    def counted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return inner(*args, **kw)

    runner.linears = dataclasses.replace(runner.linears, logits=counted)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    return out, calls[0]


def _xla_greedy(loaded, prompts, max_tokens: int, **args) -> list:
    llm = make_llm(loaded, attention_backend="xla", **args)
    assert llm.llm_engine.runner.linears is None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _tiny_tied():
    spec = tiny_spec(max_position_embeddings=512, tie_word_embeddings=True)
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="jpaged-tiny-tied-")) / "tiny-tied"
    return load_model(str(write_hf_dir(path, spec, random_weights(spec, seed=1))),
                      dtype="float32")


@pytest.mark.parametrize("which", ["lm_head", "tied"])
def test_greedy_tokens_with_the_head_on_the_kernel_equal_xla_tiny(which):
    """The tiny random Llama (vocab 300: a ragged last block) through the Pallas backend, the
    head on the kernel in every step (prefill chunks and decode, all <= 64 tokens), gives the
    XLA backend's greedy tokens."""
    loaded = tiny() if which == "lm_head" else _tiny_tied()
    assert loaded.model.spec.tie_word_embeddings == (which == "tied")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in (5, 17, 40)]
    args = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                num_gpu_blocks_override=40, block_size=16)
    llm = make_llm(loaded, attention_backend="pallas", **args)
    got, traced = _greedy_with_head_count(llm, prompts, 5)
    assert traced >= 2  # a prefill and a decode program, each with the head kernel
    assert got == _xla_greedy(loaded, prompts, 5, **args)

"""Quantized weights against the float32 model they came from: quality and cost per format.

For one model, each format (``float32``: the GGUF dequantized on the host, the reference;
``gguf``: the GGUF at its own quantization; ``fp8``: the decoder linears quantized per output
channel at load) runs the same fixed prompts two ways:

* teacher-forced: one forward per prompt (its tokens padded to one common length, dense causal
  attention, as tests/models/tiny_models.py's ``make_logits_fn``), giving the next-token
  distribution at every prompt position. Against the float32 model's: ``mean_kl`` (mean
  KL(p_float32 || p_format) in nats over all positions) and ``top1_agreement`` (argmax equal);
* generated: the engine (``LLM.generate``) greedy, ``max_tokens`` per prompt with ignore_eos,
  all prompts in one batch, one engine per format. ``greedy_agreement_<n>`` is the fraction
  of generated positions whose token equals the float32 model's at the same position (after a
  first difference the continuations usually part, so this is a strict measure;
  ``greedy_common_prefix`` is the mean number of leading tokens equal to the float32
  model's). ``tokens_per_s``: output tokens of a timed generate call over its wall time
  (prefill included), the median of a few rounds in which the formats take turns (one untimed
  call per engine first compiles every shape; the prefix cache is emptied before each timed
  call).

``weight_bytes`` is the sum of the model's parameter arrays' bytes on the device,
``weight_bytes_float32`` the same for the float32 model.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.runner.model_runner import scans_layers
from jpaged.sampling_params import SamplingParams
from models import dense_causal_attention
from models.build import LoadedModel
from models.llama import stack_layers

FORMATS = ("float32", "gguf", "fp8")
REFERENCE = "float32"

# Varied texts (prose, dialogue, code, a list, arithmetic, French, a recipe, a definition):
# 30-100 tokens each with the embedded model's and Gemma 3's tokenizers.
PROMPTS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the lens, so "
    "that ships passing in the dark would know where the rocks were.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nif __name__ == "
    "\"__main__\":\n    for i in range(10):\n        print(i, fibonacci(i))\n",
    "Q: What is the capital of France?\nA: Paris.\nQ: What is the largest planet in the solar "
    "system?\nA: Jupiter.\nQ: Who wrote the play Romeo and Juliet?\nA:",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In plants it takes place "
    "mainly in the leaves, inside small structures called chloroplasts, which contain",
    "Shopping list for the weekend:\n1. Two loaves of whole wheat bread\n2. A dozen eggs\n"
    "3. Fresh spinach and tomatoes\n4. Olive oil\n5. Three kinds of cheese\n6.",
    "Alice: Did you finish the report for Monday's meeting?\nBob: Almost. I still need the "
    "sales figures from the northern region.\nAlice: I can send them this afternoon.\nBob:",
    "If a train leaves the station at 9:00 and travels at 80 kilometres per hour, and a second "
    "train leaves the same station at 10:00 travelling at 120 kilometres per hour on the same "
    "track, the second train catches up with the first at",
    "La ville de Lyon est située au confluent du Rhône et de la Saône. Elle est connue pour "
    "sa gastronomie, ses traboules et son festival des lumières, qui attire chaque année",
    "To make a simple tomato sauce, heat two tablespoons of olive oil in a pan, add a chopped "
    "onion and cook it slowly until soft. Then add two cloves of garlic, a tin of crushed "
    "tomatoes and a pinch of salt, and let it simmer for",
    "In computer science, a hash table is a data structure that implements an associative "
    "array, a structure that can map keys to values. A hash table uses a hash function to "
    "compute an index, also called a hash code, into an array of buckets, from which",
    "Dear Professor Martin,\n\nThank you for your lecture on renewable energy last Thursday. "
    "I was particularly interested in your remarks about offshore wind farms, and I would "
    "like to ask",
    "The mitochondrion is often described as the powerhouse of the cell. It produces most of "
    "the chemical energy needed to power the cell's biochemical reactions, stored in a "
    "molecule called adenosine triphosphate, or",
]


def prompt_token_ids(tokenizer: Any, texts: Sequence[str] = PROMPTS, min_len: int = 30,
                     max_len: int = 100) -> list[list[int]]:
    """Token ids of each text (special tokens added), cut to `max_len`; ValueError when one is
    shorter than `min_len`."""
    seqs = [list(tokenizer.encode(t))[:max_len] for t in texts]
    short = [i for i, s in enumerate(seqs) if len(s) < min_len]
    if short:
        raise ValueError(f"prompts {short} have fewer than {min_len} tokens")
    return seqs


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of every parameter array of `model` (as it lies on the device)."""
    return sum(int(x.size) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def for_cpu(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with its layers stacked where the engine would stack them (XLA:CPU), so the
    engine and the teacher-forced forward share one copy and compile one layer."""
    if not scans_layers():
        return loaded
    return dataclasses.replace(loaded, model=stack_layers(loaded.model))


def logits_fn(model: nnx.Module, pad_to: int) -> Callable[[Sequence[int]], np.ndarray]:
    """ids -> float32 logits [len(ids), vocab] of one sequence, padded to `pad_to` tokens in a
    single jitted forward with dense causal attention (one compile for every prompt)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state: Any, ids: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, pos, dense_causal_attention(seg, pos, m.spec))
        return m.compute_logits(hidden)

    def logits(seq: Sequence[int]) -> np.ndarray:
        n = len(seq)
        if n > pad_to:
            raise ValueError(f"a sequence of {n} tokens does not fit pad_to={pad_to}")
        ids = np.zeros(pad_to, np.int32)
        ids[:n] = seq
        pos = np.where(np.arange(pad_to) < n, np.arange(pad_to), 0).astype(np.int32)
        seg = np.where(np.arange(pad_to) < n, 0, -1).astype(np.int32)
        out = run(state, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg))
        return np.asarray(out[:n], np.float32)

    return logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_and_top1(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, int]:
    """(sum over positions of KL(p_ref || p), positions whose argmax agrees), in float64."""
    lp_ref, lp = _log_softmax(ref_logits), _log_softmax(logits)
    kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(-1)
    agree = ref_logits.argmax(-1) == logits.argmax(-1)
    return float(np.maximum(kl, 0.0).sum()), int(agree.sum())


def teacher_forced(loaded: Mapping[str, LoadedModel], seqs: Sequence[Sequence[int]],
                   reference: str = REFERENCE) -> dict[str, dict[str, float]]:
    """Per format: mean KL against `reference` and top-1 agreement over every prompt position
    (the reference's logits made once per prompt, compared with each format's in turn)."""
    pad_to = -(-max(map(len, seqs)) // 16) * 16
    fns = {f: logits_fn(m.model, pad_to) for f, m in loaded.items()}
    kl = dict.fromkeys(loaded, 0.0)
    agree = dict.fromkeys(loaded, 0)
    positions = 0
    for seq in seqs:
        ref = fns[reference](seq)
        positions += len(seq)
        for f in loaded:
            got = ref if loaded[f] is loaded[reference] else fns[f](seq)
            k, a = kl_and_top1(ref, got)
            kl[f] += k
            agree[f] += a
    return {f: {"mean_kl": kl[f] / positions, "top1_agreement": agree[f] / positions,
                "positions": positions} for f in loaded}


def _free(llm: LLM) -> None:
    llm.llm_engine.core.runner.kv = None  # the pool goes before the next engine makes its own
    del llm
    gc.collect()


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _timed(llm: LLM, prompts: list[dict[str, Any]], max_tokens: int
           ) -> tuple[list[list[int]], float]:
    llm.reset_prefix_cache()  # every timed call computes its prompts again
    t0 = time.perf_counter()
    outs = llm.generate(prompts, _params(max_tokens))
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return ids, sum(map(len, ids)) / dt


def greedy(loaded: Mapping[str, LoadedModel], seqs: Sequence[Sequence[int]], max_tokens: int,
           engine_args: Mapping[str, Any], warmup_tokens: int | None = None, rounds: int = 3
           ) -> dict[str, dict[str, Any]]:
    """Per format: greedy generation (ignore_eos), every prompt in one generate call.

    One engine per format, each first run once untimed on the same prompts (`warmup_tokens`
    each, default `max_tokens`: compiles the step's shapes); then `rounds` timed calls per
    format, the formats taking turns (a busy machine slows them alike). `ids` per prompt (first
    round), `tokens_per_s` (median over rounds) and each round's, `repeatable` (every call's
    tokens the same, the warm-up's as far as it went) and `compiles` (step programs compiled
    during the timed calls: 0 when the warm-up covered every shape)."""
    prompts = [{"prompt_token_ids": list(s)} for s in seqs]
    llms, res = {}, {}
    for f, m in loaded.items():
        quant = None if f == "float32" else f
        llm = LLM.from_engine(LLMEngine(EngineArgs(**dict(engine_args, quantization=quant)),
                                        loaded=m))
        warm = [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, _params(warmup_tokens or max_tokens))]
        llms[f] = llm
        res[f] = {"warm": warm, "runs": [], "tps": [],
                  "compiled": llm.llm_engine.core.runner.num_compiled}
    for _ in range(rounds):
        for f, llm in llms.items():
            ids, tps = _timed(llm, prompts, max_tokens)
            res[f]["runs"].append(ids)
            res[f]["tps"].append(tps)
    out = {}
    for f, llm in llms.items():
        r = res[f]
        ids = r["runs"][0]
        out[f] = {"ids": ids, "tokens_per_s": float(np.median(r["tps"])),
                  "tokens_per_s_rounds": [round(t, 2) for t in r["tps"]],
                  "repeatable": all(x == ids for x in r["runs"]) and all(
                      x[:len(w)] == w for x, w in zip(ids, r["warm"], strict=True)),
                  "compiles": llm.llm_engine.core.runner.num_compiled - r["compiled"]}
    for f in list(llms):
        _free(llms.pop(f))
    return out


def _agreement(ids: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    same = sum(int(a == b) for x, y in zip(ids, ref, strict=True)
               for a, b in zip(x, y, strict=True))
    return same / sum(map(len, ref))


def _common_prefix(ids: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of the leading generated tokens equal to the reference's."""
    lengths = []
    for x, y in zip(ids, ref, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(y))
        lengths.append(n)
    return sum(lengths) / len(lengths)


def measure_model(label: str, loaded: Mapping[str, LoadedModel], seqs: Sequence[Sequence[int]],
                  max_tokens: int = 64, engine_args: Mapping[str, Any] | None = None,
                  warmup_tokens: int | None = None, rounds: int = 3,
                  reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per format of `loaded` (format -> model; `reference` among them, float32):
    mean_kl, top1_agreement, greedy_agreement_<max_tokens>, tokens_per_s, weight_bytes and
    weight_bytes_float32 (docstring of this module). `engine_args`: EngineArgs fields over
    the defaults here (`model`: the name the models were loaded from, for the engine's log)."""
    if reference not in loaded:
        raise ValueError(f"the formats {sorted(loaded)} lack the reference {reference!r}")
    tf = teacher_forced(loaded, seqs, reference)
    longest = max(map(len, seqs)) + max_tokens
    args = dict(model=None, dtype="float32", max_model_len=-(-longest // 16) * 16,
                max_num_seqs=max(len(seqs), 1),
                max_num_batched_tokens=max(512, -(-sum(map(len, seqs)) // 16) * 16),
                kv_cache_memory_bytes=256 * 2**20, disable_log_stats=True)
    args.update(engine_args or {})
    gen = greedy(loaded, seqs, max_tokens, args, warmup_tokens, rounds)
    ref_ids = gen[reference]["ids"]
    ref_bytes = weight_bytes(loaded[reference].model)
    rows = []
    for f in loaded:
        g = gen[f]
        rows.append({
            "model": label, "format": f,
            "mean_kl": tf[f]["mean_kl"], "top1_agreement": tf[f]["top1_agreement"],
            f"greedy_agreement_{max_tokens}": _agreement(g["ids"], ref_ids),
            "greedy_common_prefix": _common_prefix(g["ids"], ref_ids),
            "tokens_per_s": round(g["tokens_per_s"], 2),
            "tokens_per_s_vs_float32": round(
                g["tokens_per_s"] / gen[reference]["tokens_per_s"], 3),
            "tokens_per_s_rounds": g["tokens_per_s_rounds"],
            "weight_bytes": weight_bytes(loaded[f].model), "weight_bytes_float32": ref_bytes,
            "positions": tf[f]["positions"], "generated_tokens": sum(map(len, g["ids"])),
            "greedy_repeatable": g["repeatable"], "compiles_during_timed_run": g["compiles"],
        })
    return rows


def load_formats(model: str | None, formats: Sequence[str] = FORMATS
                 ) -> Iterator[tuple[str, LoadedModel]]:
    """(format, model loaded in it, layers stacked on CPU) for each format, in order."""
    from models.loader import load_model

    for f in formats:
        quant = None if f == "float32" else f
        yield f, for_cpu(load_model(model, "float32", quantization=quant))


def cpu_model() -> str:
    """The host CPU's model name (lscpu's), or the machine type where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_available(model: str | None) -> str | None:
    """None when `model` can be loaded, else why not (e.g. an optional extra not installed)."""
    from models.loader import check_model_source

    try:
        check_model_source(model)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return None


def run_quant(models: Mapping[str, str | None], formats: Sequence[str] = FORMATS,
              num_prompts: int = len(PROMPTS), max_tokens: int = 64,
              warmup_tokens: int | None = None, rounds: int = 3,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Rows for every (label -> model name) of `models` that can be loaded; the others are
    listed under `skipped` with the reason."""
    rows: list[dict[str, Any]] = []
    skipped = []
    load_before = os.getloadavg()
    for label, model in models.items():
        reason = model_available(model)
        if reason is not None:
            log(f"{label}: skipped ({reason})")
            skipped.append({"model": label, "reason": reason})
            continue
        t0 = time.perf_counter()
        loaded = dict(load_formats(model, formats))
        seqs = prompt_token_ids(loaded[REFERENCE].tokenizer, PROMPTS[:num_prompts])
        rows += measure_model(label, loaded, seqs, max_tokens, {"model": model}, warmup_tokens,
                              rounds)
        log(f"{label}: {time.perf_counter() - t0:.0f} s")
        del loaded
        gc.collect()
    return {"rows": rows, "skipped": skipped, "formats": list(formats),
            "platform": f"{cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} "
                        f"({jax.default_backend()})",
            "load_average_before_after": [round(load_before[0], 2),
                                          round(os.getloadavg()[0], 2)],
            "num_prompts": num_prompts, "max_tokens": max_tokens,
            "warmup_tokens": warmup_tokens or max_tokens, "timed_rounds": rounds,
            "teacher_forced": "one jitted forward per prompt, dense causal attention "
                              "(jpaged.bench.quant.logits_fn), float32 logits, KL in float64"}

"""xgrammar against llguidance on this CPU, on the embedded model's tokenizer: what choosing the
structured-output backend rests on (docs/benchmarks.md, "Structured outputs").

For each library: the tokenizer setup once, then per schema of jpaged/bench/schemas.py the
grammar compile (cold), and a walk of up to 48 tokens where each step computes the next-token
bitmask into a packed int32 row and consumes one allowed token (a seeded random pick among the
allowed, so both walk valid JSON). Reports seconds and microseconds, medians over schemas.

    .venv/bin/python scripts/bench_grammar_backends.py --out docs/bench/grammar_backends.json

xgrammar needs torch (its bitmask is a torch tensor): a dev-only dependency here, so this
script is the one place that imports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.bench.schemas import SCHEMAS  # noqa: E402
from models.loader import embedded_gguf_path  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

STEPS = 48


def _tokenizer() -> Tokenizer:
    from models.gguf_meta import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(embedded_gguf_path())[0])


def _walk(fill, consume, eos: set[int], words: int, seed: int) -> list[float]:
    """Mask fill + consume per step (seconds; the pick between them not counted) for up to
    STEPS tokens or until only EOS is allowed."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, words), np.int32)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fill(mask)
        t_fill = time.perf_counter() - t0
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        allowed = allowed[~np.isin(allowed, list(eos))]
        if allowed.size == 0:
            break
        tok = int(rng.choice(allowed))
        t0 = time.perf_counter()
        consume(tok)
        times.append(t_fill + time.perf_counter() - t0)
    return times


def bench_llguidance(tok: Tokenizer, vocab: int) -> dict:
    """llguidance: LLTokenizer from the tokenizer JSON, LLMatcher per schema."""
    import llguidance as llg
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - t0
    compile_s, step_us = [], []
    for i, schema in enumerate(SCHEMAS.values()):
        t0 = time.perf_counter()
        m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        compile_s.append(time.perf_counter() - t0)
        times = _walk(lambda mask, m=m: lln.fill_next_token_bitmask(m, mask, 0),
                      m.consume_token, {tok.eos_token_id}, (vocab + 31) // 32, i)
        step_us += [t * 1e6 for t in times]
    return {"setup_s": round(setup, 3), "compile_s_median": round(statistics.median(compile_s), 5),
            "compile_s_max": round(max(compile_s), 5),
            "step_us_median": round(statistics.median(step_us), 1),
            "step_us_p90": round(float(np.percentile(step_us, 90)), 1), "steps": len(step_us)}


def bench_xgrammar(tok: Tokenizer, vocab: int) -> dict:
    """xgrammar: TokenizerInfo from a transformers fast tokenizer, GrammarMatcher per schema."""
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                              stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, step_us = [], []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for i, schema in enumerate(SCHEMAS.values()):
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema))
        m = xgr.GrammarMatcher(cg)
        compile_s.append(time.perf_counter() - t0)

        def fill(mask, m=m):
            m.fill_next_token_bitmask(bitmask, 0)
            mask[:] = bitmask.numpy()

        times = _walk(fill, m.accept_token, {tok.eos_token_id}, (vocab + 31) // 32, i)
        step_us += [t * 1e6 for t in times]
    del torch
    return {"setup_s": round(setup, 3), "compile_s_median": round(statistics.median(compile_s), 5),
            "compile_s_max": round(max(compile_s), 5),
            "step_us_median": round(statistics.median(step_us), 1),
            "step_us_p90": round(float(np.percentile(step_us, 90)), 1), "steps": len(step_us)}


def main() -> int:
    """Run both and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tok = _tokenizer()
    vocab = tok.vocab_size
    res = {"vocab": vocab, "schemas": len(SCHEMAS), "llguidance": bench_llguidance(tok, vocab)}
    try:
        res["xgrammar"] = bench_xgrammar(tok, vocab)
    except ImportError as e:
        res["xgrammar"] = {"skipped": f"not installed ({e})"}
    for name in ("llguidance", "xgrammar"):
        print(name, res[name])
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

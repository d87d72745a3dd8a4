"""The cost of structured outputs: output tokens/s of one batch unconstrained, partly
constrained and all constrained, with the same tokens to produce in each run.

Each request asks for a JSON object of one of jpaged/bench/schemas.py's schemas (cycled). The
constrained run goes first (untimed) to learn how many tokens each request's grammar lets it
write; every timed run then gives request i exactly that many tokens (unconstrained rows with
`ignore_eos` and max_tokens = that count), so all runs keep the same rows busy for the same
steps and differ only in the masks (their host fill, the packed input, the sampler's unpack)
and in constrained steps being split into a forward and a sampling program. Runs alternate,
repeated, each warmed up first; the compile count is read after the warm-ups and again at the
end. `valid_fraction` is the share of constrained outputs that parse and validate.
"""

from __future__ import annotations

import json
import time
from typing import Any

from jpaged.bench.schemas import SCHEMAS
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams


def _prompts(llm: Any, batch: int) -> tuple[list[str], list[str]]:
    tok = llm.get_tokenizer()
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
    texts = []
    for n in names:
        msg = [{"role": "user", "content": f"A JSON object for a {n}."}]
        texts.append(tok.apply_chat_template(msg, add_generation_prompt=True)
                     if tok.has_chat_template else msg[0]["content"])
    return names, texts


def _params(names: list[str], lengths: list[int] | None, constrained: set[int],
            max_tokens: int) -> list[SamplingParams]:
    out = []
    for i, n in enumerate(names):
        cap = max_tokens if lengths is None else lengths[i]
        if i in constrained:
            out.append(SamplingParams(temperature=0.7, seed=i, max_tokens=cap,
                                      structured_outputs=StructuredOutputsParams(
                                          json=SCHEMAS[n])))
        else:
            out.append(SamplingParams(temperature=0.7, seed=i, ignore_eos=True, max_tokens=cap))
    return out


def _valid(name: str, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_structured(llm: Any, batch: int = 32, max_tokens: int = 200, repeats: int = 3,
                   mixed_fraction: float = 0.25) -> dict[str, Any]:
    """The three runs on `llm`; returns the figures (see the module's docstring)."""
    names, prompts = _prompts(llm, batch)
    everyone = set(range(batch))
    # Untimed: each request's length under its grammar (the later runs reuse these lengths).
    first = llm.generate(prompts, _params(names, None, everyone, max_tokens), use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in first]
    mixed = set(range(0, batch, max(1, round(1 / mixed_fraction))))
    runs = {"unconstrained": set(), "mixed": mixed, "constrained": everyone}
    for rows in runs.values():  # warm-up: every shape of every run compiled before timing
        llm.generate(prompts, _params(names, lengths, rows, max_tokens), use_tqdm=False)
    runner = llm.llm_engine.runner
    compiled_after_warmup = runner.num_compiled
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    valid = total = 0
    for _ in range(repeats):
        for name, rows in runs.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, _params(names, lengths, rows, max_tokens),
                                use_tqdm=False)
            seconds[name].append(time.perf_counter() - t0)
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != lengths:
                raise RuntimeError(f"run {name} produced {sum(got)} tokens, not {sum(lengths)}")
            for i in rows:
                total += 1
                valid += _valid(names[i], outs[i].outputs[0].text)
    tokens = sum(lengths)
    best = {k: min(v) for k, v in seconds.items()}  # least disturbed of the repeats
    tps = {k: tokens / s for k, s in best.items()}
    return {
        "batch": batch, "mixed_constrained_rows": len(mixed), "output_tokens_per_run": tokens,
        "lengths": lengths, "repeats": repeats, "seconds": seconds,
        "tokens_per_s_unconstrained": round(tps["unconstrained"], 1),
        "tokens_per_s_mixed": round(tps["mixed"], 1),
        "tokens_per_s_constrained": round(tps["constrained"], 1),
        "overhead_mixed": round(1 - tps["mixed"] / tps["unconstrained"], 4),
        "overhead_constrained": round(1 - tps["constrained"] / tps["unconstrained"], 4),
        "valid_fraction": valid / total if total else None,
        "valid_outputs": valid, "constrained_outputs": total,
        "compiles_after_warmup": compiled_after_warmup,
        "compiles_during_timed_runs": runner.num_compiled - compiled_after_warmup,
        "grammars_cached": llm.llm_engine.grammar_compiler.num_cached,
    }

"""What LoRA costs a step: the embedded SmolLM2's greedy generation with LoRA off, and with
`--enable-lora` serving the base model, one adapter, and a mix of adapters, side by side.

Every row runs the same prompts in one batch (median of the timed rounds, the rows taking
turns); `ratio` is each row's tokens/s over the LoRA-off row's. The adapters are random PEFT
files (rank `--rank` on every projection) written into a temporary directory.

    .venv/bin/python scripts/bench_lora.py --out docs/bench/lora.json   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.bench import report
from models.lora import lora_module_shapes

PROMPTS = ["Tell me about the sea.", "List three colours.", "What is a prime number?",
           "Describe a cat.", "Why is the sky blue?", "Name a river.", "How do bees fly?",
           "What is rain?"]


def write_adapter(path: Path, spec, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (n_in, n_out) in lora_module_shapes(spec).items():
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in))
                                               / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank))
                                               * 0.02).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
         "target_modules": list(lora_module_shapes(spec))}))
    return path


def main() -> None:
    """Measure each row, write JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench/lora.json"))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    common = dict(max_model_len=256, max_num_seqs=len(PROMPTS), kv_cache_memory_bytes=2**28)
    off = LLM(**common)
    lora = LLM(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank, **common)
    spec = off.llm_engine.spec
    tmp = Path(tempfile.mkdtemp(prefix="jpaged-bench-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", spec, args.rank,
                                                               i)))
                for i in range(args.max_loras)]
    n = len(PROMPTS)
    rows = {  # name -> (engine, one lora_request per prompt)
        "lora off": (off, [None] * n),
        "enable_lora, base model": (lora, [None] * n),
        "one adapter": (lora, [adapters[0]] * n),
        f"{args.max_loras} adapters mixed": (lora, [adapters[i % len(adapters)]
                                                    for i in range(n)]),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm, loras in rows.values():  # compile every shape first (untimed)
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     lora_request=loras)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, (llm, loras) in rows.items():
            t0 = time.perf_counter()
            llm.generate(PROMPTS, params, lora_request=loras)
            times[name].append(time.perf_counter() - t0)
    tokens = n * args.max_tokens
    base = tokens / report.median(times["lora off"])
    out_rows = []
    for name, ts in times.items():
        tps = tokens / report.median(ts)
        out_rows.append({"row": name, "tokens_per_s": round(tps, 1),
                         "ratio": round(tps / base, 3), "seconds": [round(t, 3) for t in ts]})
    data = {"model": "embedded SmolLM2-135M (float32)",
            "prompts": n, "max_tokens": args.max_tokens, "rank": args.rank,
            "max_loras": args.max_loras,
            "lora_slot_bytes": lora.llm_engine.runner.lora.nbytes, "rows": out_rows}
    report.write(args.out, data)
    report.print_table("LoRA on the embedded SmolLM2", [
        (r["row"], f"{r['tokens_per_s']} tok/s ({r['ratio']}x)") for r in out_rows])


if __name__ == "__main__":
    main()

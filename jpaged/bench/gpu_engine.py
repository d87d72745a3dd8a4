"""The engine end to end on random weights of a named shape: the device check's engine half.

No checkpoint is read (none can travel to the GPU machine): the model is initialized with random
weights on the device and a 258-token byte tokenizer stands in (ids it does not know decode to
nothing). Per KV dtype: the Pallas and the XLA attention paths run the same greedy mixed batch
(prompts of 17..700 tokens, so chunked prefill and decode mix) and must give the same tokens;
the Pallas engine then measures output tokens/s at several batch sizes and (first KV dtype)
compares the synchronous and the overlapped loop on the largest, and each engine reports the
pool it chose. `--cpu-smoke` runs the same on a tiny shape with the Pallas interpreter.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jpaged.bench.decode_rows import decode_rows
from jpaged.bench.fixtures import TINY_CONFIG, random_model
from jpaged.bench.verify_rows import parse_cases, verify_table
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.sampling_params import SamplingParams
from models.config import ModelSpec
from models.loader import LoadedModel


@dataclass(frozen=True)
class EngineCheckConfig:
    """Shapes and sizes of one run (GPU or CPU smoke)."""

    spec: ModelSpec
    prompt_lens: tuple[int, ...]  # the mixed greedy batch
    new_tokens: int
    batches: tuple[int, ...]  # throughput batch sizes
    bench_prompt: int
    bench_new: int
    engine_args: dict[str, Any]
    # Decode step rows at fixed contexts (jpaged/bench/decode_rows.py): `make gpu-aot`'s
    # predicted rows, measured.
    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_contexts: tuple[int, ...] = (1024, 4096)
    decode_args: dict[str, Any] = field(default_factory=dict)


def _prompts(lens: tuple[int, ...], vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, min(vocab, 50000), n).tolist()} for n in lens]


def _engine(loaded: LoadedModel, kv_dtype: str, backend: str, args: dict[str, Any]) -> LLM:
    engine = LLMEngine(EngineArgs(kv_cache_dtype=kv_dtype, attention_backend=backend,
                                  disable_log_stats=True, **args), loaded=loaded)
    return LLM.from_engine(engine)


def _greedy(llm: LLM, prompts: list[dict[str, list[int]]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _bench_workload(cfg: EngineCheckConfig, batch: int) -> tuple[list[Any], SamplingParams,
                                                                  dict[str, int]]:
    """The throughput workload of `batch`: its prompts, greedy params, and their description."""
    prompts = _prompts((cfg.bench_prompt,) * batch, cfg.spec.vocab_size, seed=batch)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.bench_new, ignore_eos=True)
    return prompts, sp, {"batch": batch, "prompt_tokens": cfg.bench_prompt,
                         "new_tokens": cfg.bench_new}


def _throughput(llm: LLM, cfg: EngineCheckConfig, batch: int) -> dict[str, Any]:
    prompts, sp, desc = _bench_workload(cfg, batch)
    llm.generate(prompts, sp, use_tqdm=False)  # compiles this batch's shapes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {**desc, "wall_s": round(wall, 4), "output_tokens_per_s": round(toks / wall, 1)}


def _overlap(llm: LLM, cfg: EngineCheckConfig, rounds: int = 3) -> dict[str, Any]:
    """The synchronous and the overlapped loop on the throughput workload of the largest batch:
    tokens/s of each, their ratio, outputs compared (jpaged.bench.host.overlap_rows)."""
    from jpaged.bench.host import overlap_rows

    prompts, sp, desc = _bench_workload(cfg, cfg.batches[-1])
    return {**desc, **overlap_rows(llm, prompts, sp, rounds)}


def _pool(llm: LLM) -> dict[str, Any]:
    m = llm.get_metrics()
    kv = llm.llm_engine.runner.kv
    return {"num_blocks": int(m["num_blocks_total"]),
            "pool_bytes": int(kv.k.nbytes + kv.v.nbytes),
            "block_size": llm.llm_engine.config.cache.block_size}


def run_engine_check(cfg: EngineCheckConfig, kv_dtypes: tuple[str, ...], model_dtype: Any,
                     budget_s: float = 1e9, loaded: LoadedModel | None = None,
                     progress: Callable[[dict[str, Any]], None] | None = None
                     ) -> dict[str, Any]:
    """Greedy Pallas-vs-XLA equality, tokens/s and the chosen pool, per KV dtype; `progress`
    gets the document so far after each KV dtype (a caller's time limit keeps those)."""
    t_start = time.perf_counter()
    loaded = loaded or random_model(cfg.spec, model_dtype)
    prompts = _prompts(cfg.prompt_lens, cfg.spec.vocab_size, seed=1)
    out: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                           "model": f"random {cfg.spec.architecture} {cfg.spec.num_layers}L "
                                    f"{cfg.spec.num_heads}q/{cfg.spec.num_kv_heads}kv "
                                    f"d{cfg.spec.head_dim}",
                           "prompt_lens": list(cfg.prompt_lens), "runs": []}
    for kvd in kv_dtypes:
        tokens: dict[str, list[list[int]]] = {}
        run: dict[str, Any] = {"kv_cache_dtype": kvd}
        for backend in ("xla", "pallas"):
            t0 = time.perf_counter()
            llm = _engine(loaded, kvd, backend, cfg.engine_args)
            run[f"{backend}_start_s"] = round(time.perf_counter() - t0, 2)
            run[f"{backend}_pool"] = _pool(llm)
            tokens[backend] = _greedy(llm, prompts, cfg.new_tokens)
            # Progress as it goes: a run cut short by its caller's timeout keeps its figures.
            print(f"  kv {kvd} {backend}: started in {run[f'{backend}_start_s']} s, pool "
                  f"{run[f'{backend}_pool']}, greedy at {time.perf_counter() - t_start:.0f} s",
                  flush=True)
            if backend == "pallas":
                run["throughput"] = []
                for b in cfg.batches:
                    if time.perf_counter() - t_start > budget_s:
                        run["throughput"].append({"batch": b, "skipped": "time budget"})
                        continue
                    run["throughput"].append(_throughput(llm, cfg, b))
                    print(f"  kv {kvd} throughput {run['throughput'][-1]}", flush=True)
                if kvd == kv_dtypes[0]:  # the loops compared once, on the first KV dtype
                    run["overlap"] = ({"skipped": "time budget"}
                                      if time.perf_counter() - t_start > budget_s
                                      else _overlap(llm, cfg))
            llm.llm_engine.runner.kv = None  # free the pool before the next engine's
            del llm
            gc.collect()
        same = [a == b for a, b in zip(tokens["xla"], tokens["pallas"], strict=True)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                      for a, b in zip(tokens["xla"], tokens["pallas"], strict=True)]
        run.update(greedy_equal=all(same), equal_per_prompt=same, first_difference=first_diff,
                   tokens_pallas=tokens["pallas"], tokens_xla=tokens["xla"])
        out["runs"].append(run)
        print(f"  kv {kvd} pallas==xla greedy: {run['greedy_equal']} (first differences "
              f"{first_diff}) at {time.perf_counter() - t_start:.0f} s", flush=True)
        if progress is not None:
            progress({**out, "wall_s": round(time.perf_counter() - t_start, 1)})
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def gpu_config() -> EngineCheckConfig:
    """Llama-3-8B's shape in bf16 on the GPU: a mixed batch and batches 1, 32, 128."""
    from jpaged.aot.cases import LLAMA3_8B_CONFIG

    return EngineCheckConfig(
        spec=ModelSpec.from_hf_config(LLAMA3_8B_CONFIG), prompt_lens=(17, 100, 300, 700),
        new_tokens=16, batches=(1, 32, 128), bench_prompt=128, bench_new=64,
        engine_args={"max_model_len": 1024, "max_num_seqs": 128})


def smoke_config() -> EngineCheckConfig:
    """A tiny shape for the CPU rehearsal (small pool, few tokens)."""
    return EngineCheckConfig(
        spec=ModelSpec.from_hf_config(TINY_CONFIG), prompt_lens=(5, 17, 40), new_tokens=4,
        batches=(1, 4), bench_prompt=16, bench_new=4,
        engine_args={"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64,
                     "kv_cache_memory_bytes": 16 * 2**20},
        decode_batches=(1, 4), decode_contexts=(40,),
        # The Pallas backend (the interpreter here), as "auto" is on a GPU: the rows then run
        # the decode matmul kernels and their XLA twin, the A/B the GPU run times.
        decode_args={"max_num_batched_tokens": 64, "kv_cache_memory_bytes": 16 * 2**20,
                     "attention_backend": "pallas"})


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit 1 when the Pallas and XLA greedy tokens differ, or the two loops'."""
    import argparse
    import json
    from pathlib import Path

    import jax.numpy as jnp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape, Pallas interpreter")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--budget-s", type=float, default=270.0, help="skip throughput after this")
    p.add_argument("--decode-budget-s", type=float, default=150.0,
                   help="skip the remaining decode step rows after this")
    p.add_argument("--decode-kv", nargs="+", choices=["bfloat16", "fp8_e4m3"],
                   help="KV dtypes of the decode step rows (default: both)")
    p.add_argument("--decode-batches", nargs="+", type=int,
                   help="batches of the decode step rows (default: the configuration's)")
    p.add_argument("--profile-batches", nargs="+", type=int, default=[],
                   help="profile these batches' decode rows (first KV dtype and context)")
    p.add_argument("--sampled-batches", nargs="+", type=int, default=[],
                   help="time these batches' decode rows again drawing at random through "
                        "every filter (first KV dtype and context)")
    p.add_argument("--profile-dir", type=Path,
                   help="where the profiled rows' traces go (default: jpaged-profiles in the "
                        "temporary directory; a lent GPU brings back 8 files, no traces)")
    p.add_argument("--no-decode-ab", action="store_true",
                   help="time the engine's decode step only, not also its twin with XLA's "
                        "GEMMs for the projections (ModelRunner decode_matmuls=False)")
    p.add_argument("--verify-rows", type=parse_cases, default=(), metavar="BxK,...",
                   help="time speculative decoding's verifying step of B sequences with K "
                        "proposals each beside the plain decode step of B (first KV dtype "
                        "and context; jpaged/bench/verify_rows.py), e.g. 1x7,16x3")
    p.add_argument("--part", choices=["all", "check", "decode"], default="all",
                   help="check: the engine check alone; decode: the decode step rows alone "
                        "(so a caller can give each its own time limit)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    cfg = smoke_config() if args.cpu_smoke else gpu_config()
    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    kv_dtypes = ("bfloat16", "fp8_e4m3")
    loaded = random_model(cfg.spec, dtype)

    def partial(doc: dict[str, Any]) -> None:  # the runs so far, should a time limit cut in
        if args.out:
            args.out.write_text(json.dumps({**doc, "mode": "cpu-smoke" if args.cpu_smoke
                                            else "gpu", "partial": True, "decode_rows": []},
                                           indent=1))

    res = (run_engine_check(cfg, kv_dtypes, dtype, budget_s=args.budget_s, loaded=loaded,
                            progress=partial)
           if args.part != "decode" else
           {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "model": f"random {cfg.spec.architecture}", "runs": [], "wall_s": 0.0})
    res["mode"] = "cpu-smoke" if args.cpu_smoke else "gpu"
    res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    profile_dir = args.profile_dir or Path(tempfile.gettempdir()) / "jpaged-profiles"
    t0 = time.perf_counter()
    res["verify_rows"] = []
    res["decode_rows"] = ([] if args.part == "check" else
                          decode_rows(loaded, tuple(args.decode_kv or kv_dtypes),
                                      tuple(args.decode_batches or cfg.decode_batches),
                                      cfg.decode_contexts, cfg.decode_args,
                                      budget_s=args.decode_budget_s,
                                      profile_batches=tuple(args.profile_batches),
                                      profile_dir=profile_dir,
                                      sampled_batches=tuple(args.sampled_batches),
                                      ab=not args.no_decode_ab,
                                      verify=args.verify_rows,
                                      verify_out=res["verify_rows"]))
    res["wall_s"] = round(res["wall_s"] + time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(f"engine check on {res['device']} (jax {res['jax']}): {res['model']}")
    for run in res["runs"]:
        tput = ", ".join(f"B={t['batch']}: {t.get('output_tokens_per_s', t.get('skipped'))}"
                         for t in run["throughput"])
        print(f"  kv {run['kv_cache_dtype']:9s} pallas==xla greedy: {run['greedy_equal']} "
              f"(first differences {run['first_difference']}); pool {run['pallas_pool']}; "
              f"tokens/s {tput}")
        ov = run.get("overlap")
        if ov is not None and "skipped" not in ov:
            print(f"  overlap at batch {ov['batch']}: tokens/s sync {ov['tokens_per_s_sync']}, "
                  f"async {ov['tokens_per_s_async']}, async_ratio {ov['async_ratio']} "
                  f"(per round {ov['async_ratio_per_round']}), outputs identical "
                  f"{ov['outputs_identical']}")
    for row in res["decode_rows"]:
        got = (f"{row['step_ms']} ms/step, {row['output_tokens_per_s']} tok/s"
               if "step_ms" in row else f"skipped: {row['skipped']}")
        if "ms_kernels" in row:  # the A/B: the same step with XLA's GEMMs for the projections
            got += (f"; XLA's GEMMs {row['ms_xla']} ms, kernels {row['ms_kernels']} ms "
                    f"(xla/kernels {row['xla_over_kernels']}x)")
        elif "decode_matmuls" in row:
            got += f"; matmuls: {row['decode_matmuls']}"
        if row.get("sampling"):
            got += f" [{row['sampling']} sampling]"
        print(f"  decode kv {row['kv_cache_dtype']:9s} B={row['batch']:<4} "
              f"ctx={row['context_len']:<5} {got}")
    if res["verify_rows"]:  # speculative decoding's verifying steps beside plain decode
        print("\n".join(verify_table(res["verify_rows"])))
    print(f"  done in {res['wall_s']} s")
    ok = all(r["greedy_equal"] and r.get("overlap", {}).get("outputs_identical", True)
             for r in res["runs"])
    return 0 if ok else 1

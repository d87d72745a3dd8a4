"""This checkout against a git revision on the embedded model: warm-up compile seconds and
decode ms per step, each side in its own fresh process, interleaved, in one run.

    python scripts/bench_step_ab.py --baseline REV [--rounds 2] [--batches 1 32 64]
        [--out docs/bench/step_ab.json]

The baseline is checked out with `git worktree` into a temporary directory and imported from
there (PYTHONPATH), so both sides run the same measurement on the same machine minutes apart:
engine start-up (load, memory probe), `runner.warmup()` over every bucket shape (no persistent
compilation cache), then the median decode step at each batch (`host_overhead`'s device ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in each child with PYTHONPATH = the side's tree; prints one JSON line.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jpaged.bench.engine_bench import host_overhead
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from models.loader import load_model
loaded = load_model(None, dtype="float32")
t1 = time.perf_counter()
engine = LLMEngine(EngineArgs(disable_log_stats=True), loaded=loaded)
t2 = time.perf_counter()
shapes = engine.runner.warmup()
t3 = time.perf_counter()
out = {"load_s": t1 - t0, "engine_init_s": t2 - t1, "warmup_s": t3 - t2,
       "compiled_shapes": shapes}
for b in json.loads(sys.argv[1]):
    out[f"decode_ms_b{b}"] = host_overhead(engine, b, steps=int(sys.argv[2]))["device_ms"]
print(json.dumps(out))
"""


def run_side(tree: Path, batches: list[int], steps: int) -> dict:
    """One fresh process importing jpaged from `tree`; its measurements."""
    # Cold compiles on both sides: no persistent compilation cache (jpaged's own is off).
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu",
               JPAGED_COMPILE_CACHE_DIR="off")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(batches), str(steps)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"measurement in {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Check out the baseline, run both sides alternately, write JSON, print the medians."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=2, help="processes per side (alternating)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/step_ab.json"))
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="jpaged-ab-") as tmp:
        base_tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"baseline": [], "current": []}
            for r in range(args.rounds):
                for side, tree in (("baseline", base_tree), ("current", ROOT)):
                    runs[side].append(run_side(tree, args.batches, args.steps))
                    print(f"round {r} {side}: {json.dumps(runs[side][-1])}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT,
                           capture_output=True)
    keys = list(runs["current"][0])
    med = {side: {k: statistics.median(x[k] for x in rs) for k in keys}
           for side, rs in runs.items()}
    ratio = {k: med["current"][k] / med["baseline"][k] for k in keys if med["baseline"][k]}
    data = {"baseline": rev, "current": head, "dirty": bool(subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
        capture_output=True, text=True).stdout.strip()), "rounds": runs, "median": med,
        "ratio_current_over_baseline": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(f"{'figure':<22}{'baseline ' + rev:>18}{'current ' + head:>18}{'ratio':>8}")
    for k in keys:
        print(f"{k:<22}{med['baseline'][k]:>18.2f}{med['current'][k]:>18.2f}"
              f"{ratio.get(k, float('nan')):>8.3f}")


if __name__ == "__main__":
    main()

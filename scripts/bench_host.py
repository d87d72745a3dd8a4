"""Host work per engine step, synchronous vs overlapped loop, and the embedded model's tokens/s.

    python scripts/bench_host.py [--quick] [--out docs/bench/host.json]
    python scripts/bench_host.py --quick --no-embedded --batches 64 256 --no-plot  # device check

Writes `rows` (batch, mode, host_us_per_step, host_us_per_request_step), `core_process_rows`
(the same async decode with the engine core in its own process: the core loop's µs, and the
front end's, per step and per request per step), `embedded`
(tokens_per_s_sync, tokens_per_s_async, async_ratio: the median of the rounds' own
sync/async ratios, outputs_identical) and `timelines` (the
host phases and device spans of a few overlapped steps of the embedded model, device-bound,
and of the tiny model at the largest batch, host-bound), plus two plots:
OUT.png (host µs per request per step) and OUT_timeline.png. Host µs are the engine thread's
CPU time per `step()` (`time.thread_time`): waiting for the device is not counted.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# The device step on one core, the host on the other (as a GPU leaves the CPU to the host):
# XLA:CPU would otherwise spread each step over both cores and the host thread would be timed
# while it waits for a core. Set before jax is imported; an XLA_FLAGS of your own wins.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1")

from jpaged.bench import report  # noqa: E402
from jpaged.bench.host import (  # noqa: E402
    core_process_rows,
    embedded_rows,
    host_engine,
    host_model,
    host_rows,
    plot_timeline,
    timeline,
)
from models.loader import load_model  # noqa: E402

BATCHES = (1, 16, 64, 256)
CORE_BATCHES = (64, 256)  # the engine core in its own process (--engine-core-process)


def main() -> None:
    """Parse flags, measure, write JSON + PNGs, print the tables (exit 1 if the core process
    rows failed; the rest is written all the same)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and tokens (~2 min)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/host.json"))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                    help="decode batch sizes of the host rows (the largest is the timeline's; "
                         "the core process rows take 64 and 256 up to it, else it)")
    ap.add_argument("--no-embedded", action="store_true",
                    help="skip the embedded model (the device check: it cannot travel there)")
    ap.add_argument("--no-core-process", action="store_true",
                    help="skip the rows with the engine core in its own process")
    ap.add_argument("--no-plot", action="store_true", help="JSON and tables only (no matplotlib)")
    args = ap.parse_args()
    batches = tuple(sorted(set(args.batches)))
    if batches[0] < 1:
        ap.error(f"--batches must be positive, got {args.batches}")
    steps = 8 if args.quick else 24
    # One tiny-model engine for the host rows and its timeline (one compile of its shapes).
    engine = host_engine(host_model(), True, batches[-1])
    rows = host_rows(batches, steps, rounds=1 if args.quick else 3, engine=engine)
    core_batches = tuple(b for b in CORE_BATCHES if b <= batches[-1]) or batches[-1:]
    core_rows: list = []
    core_error = None
    if not args.no_core_process:
        try:
            core_rows = core_process_rows(core_batches[-1:] if args.quick else core_batches,
                                          steps, rounds=1 if args.quick else 3)
        except Exception as e:  # e.g. a GPU that takes one process only: keep the other rows
            core_error = f"{type(e).__name__}: {e}"
            print(f"core process rows failed: {core_error}")
    timelines = {}
    emb = None
    if not args.no_embedded:
        loaded = load_model(None, dtype="float32")
        emb = embedded_rows(16, 16 if args.quick else 48, loaded, rounds=5 if args.quick else 9)
        from jpaged.config import EngineArgs
        from jpaged.engine import LLMEngine

        tl_engine = LLMEngine(EngineArgs(max_num_seqs=16, max_model_len=512,
                                         kv_cache_memory_bytes=256 * 2**20,
                                         disable_log_stats=True), loaded=loaded)
        timelines["embedded SmolLM2, 16 requests"] = timeline(tl_engine, batch=16, steps=4)
    engine.set_async_scheduling(True)  # the timeline shows the overlapped loop
    timelines[f"tiny model, {batches[-1]} requests"] = timeline(engine, batch=batches[-1],
                                                                steps=4)
    data = {"quick": args.quick, "steps": steps, "rows": rows, "core_process_rows": core_rows,
            "core_process_error": core_error, "embedded": emb, "timelines": timelines}

    def plot(ax):
        for mode, color in (("sync", "#e08a2c"), ("async", "#2a7ab9")):
            pts = [r for r in rows if r["mode"] == mode]
            ax.plot([r["batch"] for r in pts], [r["host_us_per_request_step"] for r in pts],
                    "o-", color=color, label=mode)
        if core_rows:
            ax.plot([r["batch"] for r in core_rows],
                    [r["host_us_per_request_step"] for r in core_rows], "s--", color="#2a9d5c",
                    label="async, engine core in its own process (core loop)")
        ax.axhline(10, color="grey", ls=":", lw=1, label="target (async, batch 256)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decoding requests")
        ax.set_ylabel("host µs per request per step")
        ratio = "" if emb is None else (
            f"; embedded model async/sync tokens/s {emb['async_ratio']:.2f}x")
        ax.set_title(f"host work per step (tiny model){ratio}", fontsize=9)
        ax.legend(fontsize=8)

    report.write(args.out, data, None if args.no_plot else plot)
    if not args.no_plot:
        plot_timelines(args.out.with_name(args.out.stem + "_timeline.png"), timelines)
    report.print_table("host µs per step", [
        (f"{r['mode']} batch {r['batch']}",
         f"{r['host_us_per_step']} µs/step, {r['host_us_per_request_step']} µs/request")
        for r in rows])
    if core_rows:
        report.print_table("engine core in its own process (async)", [
            (f"batch {r['batch']}",
             f"core {r['host_us_per_step']} µs/step, {r['host_us_per_request_step']} "
             f"µs/request; front end {r['frontend_us_per_step']} µs/step, "
             f"{r['frontend_us_per_request_step']} µs/request") for r in core_rows])
    if emb is not None:
        report.print_table("embedded model", list(emb.items()))
    if core_error is not None:
        raise SystemExit(1)  # after everything else is written


def plot_timelines(out: Path, timelines: dict) -> None:
    """One panel per timeline: host phases above device spans."""
    import jax
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend = "XLA:CPU" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    fig, axes = plt.subplots(len(timelines), 1, figsize=(7, 2.6 * len(timelines)),
                             squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], timelines.items(), strict=True):
        plot_timeline(ax, events, f"4 overlapped decode steps: {title} ({backend})")
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()

"""`scripts/gpu_aot.py`: argument parsing and the JSON / table output of `report.run`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from jpaged.aot.target import cuda_plugin_error


def _option(text: str) -> tuple[str, bool | int | str]:
    """NAME=VALUE of --xla-option: true/false as booleans, integers as integers."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("xla_"):
        raise ValueError(f"--xla-option {text!r}: expected xla_<name>=<value>")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    """Run the deviceless H200 compile check; exit 1 on a problem, 2 when it cannot run."""
    p = argparse.ArgumentParser(description="Compile every engine step for an H200, deviceless.")
    p.add_argument("--quick", action="store_true",
                   help="a decode and the largest mixed shape per configuration")
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--decode", action="store_true",
                   help="only the decode shapes (batch 1, 16, 64, 256) of every configuration")
    p.add_argument("--spec", action="store_true",
                   help="the verifying steps of speculative decoding (batch 1, 16 x k = 1, 2, "
                        "4, 8 proposals: ragged steps of B sequences of k + 1 tokens), the "
                        "plain decode step of each batch and a draft model's proposal steps "
                        "(Llama-3.2-1B for Llama-3-8B) of every configuration, under "
                        "'spec_verify' and 'spec_cycles'; with --decode or --quick, those "
                        "cases too")
    p.add_argument("--only", help="only configurations whose model[-weights]/kv_dtype/backend/"
                                  "tp<N> contains this (or one of these, comma-separated), "
                                  "e.g. llama3-8b/bfloat16/pallas/tp1,llama3-8b-int4")
    p.add_argument("--markdown", type=Path, metavar="JSON",
                   help="print the tables of an earlier run's JSON as markdown, compile nothing")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compile option for every program, e.g. "
                        "xla_gpu_experimental_force_split_k=1 (repeatable); these go over the "
                        "command-buffer options every program gets (launches."
                        "COMMAND_BUFFER_OPTIONS): xla_gpu_enable_command_buffer= turns "
                        "CUDA graphs off")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    try:
        options = dict(_option(text) for text in args.xla_option)
    except ValueError as e:
        p.error(str(e))
    if args.markdown:
        from jpaged.aot.markdown import render

        print(render(json.loads(args.markdown.read_text())))
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    why = cuda_plugin_error()
    if why:
        print(f"gpu_aot: {why}", file=sys.stderr)
        return 2
    from jpaged.aot.report import run

    t0 = time.perf_counter()
    doc = run(args.quick, only=args.only, decode_only=args.decode, xla_options=options,
              spec=args.spec)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    for s in doc["sizing"]:
        print(f"  sizing {s['model']} {s['kv_cache_dtype']} {s['backend']} "
              f"tp{s['tensor_parallel_size']}: act GPU {s['activation_bytes_gpu']} "
              f"CPU {s.get('activation_bytes_cpu_probe')} estimate "
              f"{s['estimate_activation_bytes']}; blocks {s['num_blocks']} "
              f"(estimate {s['estimate_num_blocks']})")
    from jpaged.aot.markdown import cycle_table, hbm_table, programs, spec_table

    if doc["cases"]:
        print(hbm_table(doc))
    if doc.get("spec_verify"):
        print(spec_table(doc))
    if doc.get("spec_cycles"):
        print(cycle_table(doc))
    print(f"gpu_aot: {programs(doc)} programs, {len(doc['problems'])} problems, "
          f"{doc['wall_s']} s (jax {doc['jax_version']})")
    for line in doc["problems"]:
        print(f"  PROBLEM {line}")
    return 1 if doc["problems"] else 0

"""What the `jpaged` commands share: errors that name the flag, logging, building the engine,
and the worker loop of the processes other than process 0 of a multi-process run."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import typer

from jpaged.cli_engine_flags import engine_args

# "SamplingParams.top_p must ..." names the field; engine and sampling flags are spelled as
# their fields (--top-p), so the message can name the flag too.
_FIELD_RE = re.compile(r"\b(?:SamplingParams|CacheConfig|SchedulerConfig|ModelConfig|"
                       r"ParallelConfig|EngineArgs)\.(\w+)\b"
                       r"|\b(kv_events_config|kv_transfer_config|structured_outputs_config|"
                       r"speculative_config)\b")


def fail(msg: str) -> NoReturn:
    """Stop the command with exit status 2 and `msg` on stderr, led by the flag it names."""
    m = _FIELD_RE.search(msg)
    if m is not None:
        msg = f"--{(m.group(1) or m.group(2)).replace('_', '-')}: {msg}"
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def setup_logging(verbose: bool) -> None:
    """Log to stderr: INFO with --verbose, else warnings only."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def create_engine(args: Any) -> Any:
    """The engine `args` ask for (in this process, or its core in a process of its own)."""
    from jpaged.core_client import create_engine as create

    return create(args)


def run_worker_if_not_rank0(engine_flags: Mapping[str, Any]) -> bool:
    """Processes 1..nnodes-1 of a multi-process run: run the steps process 0 sends until it
    says stop (True), or exit with the error; process 0 and single-process runs: False."""
    if engine_flags.get("nnodes", 1) <= 1 or engine_flags.get("node_rank", 0) == 0:
        return False
    from jpaged.multiprocess_worker import run_worker
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now

    try:
        run_worker(engine_args(engine_flags))
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except ProcessGroupError as e:
        exit_now(e)
    return True

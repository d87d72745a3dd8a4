"""Processes 1..nnodes-1 of a multi-process run: build the same engine, launch every step that
process 0 announces, return when it says stop.

The loop builds an `EngineCore` (no front end: it takes no requests), so it stands above the
engine (docs/architecture.md, import floors); the process group, step channel and step wire
format it uses are jpaged/runner/multiprocess.py's, shared with process 0's engine. Faults:
that module's docstring.
"""

from __future__ import annotations

import logging

from jpaged.config import EngineArgs
from jpaged.engine_core import EngineCore
from jpaged.runner.multiprocess import ProcessGroup, ProcessGroupError, decode_step

logger = logging.getLogger("jpaged")


def run_worker(args: EngineArgs) -> None:
    """A process other than 0: join, build the same engine, launch every step process 0 sends,
    return when it says stop. Raises ProcessGroupError / ValueError (jpaged.runner.multiprocess)."""
    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError("run_worker is for processes 1..nnodes-1 of a multi-process run "
                         f"(got nnodes={args.nnodes}, node_rank={args.node_rank})")
    group = ProcessGroup(args)
    # Loads alongside process 0 (an orbax restore is collective), then takes its pool size.
    engine = EngineCore(args, group=group)
    runner = engine.runner
    steps = 0
    while True:
        header, buffers = group.channel.recv()
        if header["op"] == "stop":
            break
        if header["op"] != "step":
            raise ProcessGroupError(f"unexpected message from process 0: {header}")
        flat, flags = decode_step(header, buffers)
        try:
            runner.launch(flat, flags, header["calc"], scratch=header["scratch"])
        except Exception as e:  # a collective with a process that is gone
            raise group.failed(e) from e
        steps += 1
    logger.info("process %d: %d steps, process 0 said stop", group.rank, steps)
    group.stop()
    engine.shutdown()

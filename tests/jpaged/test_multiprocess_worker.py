"""The loop of processes 1..nnodes-1 (jpaged/multiprocess_worker.py); the runs over several
processes are tests/jpaged/runner/test_multiprocess.py's."""

from __future__ import annotations

import pytest

from jpaged.config import EngineArgs
from jpaged.multiprocess_worker import run_worker


@pytest.mark.parametrize("kwargs", [dict(), dict(nnodes=2, node_rank=0)])
def test_run_worker_is_only_for_the_other_processes(kwargs):
    with pytest.raises(ValueError, match=r"run_worker is for processes 1\.\.nnodes-1"):
        run_worker(EngineArgs(**kwargs))

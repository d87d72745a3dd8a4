"""Request: token bookkeeping, incremental block hashes, status and ordering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jpaged.core.block_hash import BlockHasher, hash_request_blocks
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]


def test_tokens_and_hashes_grow_incrementally():
    r = Request("r", list(range(10)), SamplingParams(max_tokens=20), cache_salt="s",
                block_hasher=BlockHasher(4, "xxhash"))
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (10, 0, 10)
    assert len(r.block_hashes) == 2 and r.status is RequestStatus.WAITING
    for t in range(100, 107):
        r.append_output_token(t)
    assert r.all_token_ids == list(range(10)) + list(range(100, 107))
    assert r.output_token_ids == list(range(100, 107)) and r.num_tokens == 17
    assert r.block_hashes == hash_request_blocks(r.all_token_ids, 4, "xxhash", "s")
    r.set_block_hasher(BlockHasher(8))
    assert r.block_hashes == hash_request_blocks(r.all_token_ids, 8, cache_salt="s")


def test_status_and_finish_reason():
    r = Request("r", [1], SamplingParams())
    assert r.finish_reason is None and not r.is_finished()
    for status, reason in [(RequestStatus.FINISHED_STOPPED, "stop"),
                           (RequestStatus.FINISHED_LENGTH, "length"),
                           (RequestStatus.FINISHED_ABORTED, "abort")]:
        r.status = status
        assert r.finish_reason == reason and r.is_finished()
        assert RequestStatus.is_finished(status)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)


def test_sort_key_priority_then_arrival_then_creation():
    sp = SamplingParams()
    a = Request("a", [1], sp, priority=1, arrival_time=0.0)
    b = Request("b", [1], sp, priority=0, arrival_time=5.0)
    c = Request("c", [1], sp, priority=0, arrival_time=5.0)
    d = Request("d", [1], sp, priority=0, arrival_time=1.0)
    assert sorted([a, b, c, d], key=lambda r: r.sort_key) == [d, b, c, a]


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())


def test_core_never_imports_jax():
    code = ("import sys\n"
            "import jpaged.request, jpaged.core.block_hash, jpaged.core.block_pool\n"
            "import jpaged.core.kv_cache_manager, jpaged.core.request_queue\n"
            "import jpaged.core.sched_output\n"
            "import jpaged.core.scheduler\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

"""`jpaged serve` as a user starts it: a subprocess bound to 127.0.0.1, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
from helpers import free_port, tiny_model_dir, wait_until_healthy
from typer.testing import CliRunner

from jpaged.cli import app


def test_serve_subprocess_binds_localhost_and_stops_on_sigint():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jpaged.cli", "serve", "--model", str(tiny_model_dir()),
         "--port", str(port), "--api-key", "k3y", "--served-model-name", "srv",
         "--max-model-len", "64", "--num-gpu-blocks-override", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(proc, port, lambda: proc.communicate()[1])
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                      headers={"Authorization": "Bearer k3y"})
        assert [m["id"] for m in r.json()["data"]] == ["srv"]
        assert r.json()["data"][0]["max_model_len"] == 64
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}" in err  # the default host
    assert "froze the GC heap after start-up" in err  # the server owns its process


def test_freeze_gc_heap_freezes_start_up_objects_unless_disabled():
    """In a fresh interpreter (freezing pytest's own heap would outlive the test). Python 3.12
    starts with a few hundred objects frozen already (3.11 with none): counts are against that."""
    code = ("import gc; start = gc.get_freeze_count(); from jpaged.gc_heap import freeze_gc_heap; "
            "n = freeze_gc_heap(); print(start, n, gc.get_freeze_count())")
    for env, frozen in (({}, True), ({"JPAGED_GC_FREEZE": "0"}, False)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env}, check=True).stdout.split()
        start, n, count = (int(x) for x in out)
        if frozen:
            assert n == count > start + 1000, (env, out)
        else:
            assert n == 0 and count == start, (env, out)


def test_serve_help_lists_server_and_engine_flags():
    r = CliRunner().invoke(app, ["serve", "--help"], env={**os.environ, "COLUMNS": "200"})
    assert r.exit_code == 0
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--disable-log-stats",
                 "--gpu-memory-utilization", "--block-size", "--enable-prefix-caching",
                 "--kv-cache-dtype", "--max-num-seqs", "--max-model-len",
                 "--tensor-parallel-size", "--preemption-mode", "--data-parallel-size",
                 "--data-parallel-backend", "--ray-address", "--routing-policy",
                 "--kv-events-config"):
        assert flag in r.stdout, flag


def test_serve_refuses_bad_data_parallel_flags_before_starting_anything():
    for args, msg in ((["--data-parallel-size", "2", "--routing-policy", "random"],
                       "--routing-policy must be one of"),
                      (["--data-parallel-backend", "mp"], "--data-parallel-backend must be ray"),
                      (["--data-parallel-size", "2", "--kv-events-config",
                        '{"enable_kv_cache_events": true}'], "kv_events_config is set by")):
        r = CliRunner().invoke(app, ["serve", *args])
        assert r.exit_code == 2, r.output
        assert msg in r.output and "Traceback" not in r.output

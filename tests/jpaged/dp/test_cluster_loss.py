"""`jpaged serve --data-parallel-size 2` when Ray loses its node: killing the raylet takes every
replica with it, and the server, instead of answering 503 forever, exits non-zero within its
--replica-dead-timeout-s, naming the cause, so a supervisor can restart it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import free_port, tiny_model_dir, wait_until_healthy

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

WAIT_S = 180


def test_server_exits_when_ray_loses_its_node(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 (read back below)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jpaged.cli", "serve", "--model", str(tiny_model_dir()),
         "--port", str(port), "--data-parallel-size", "2", "--max-model-len", "64",
         "--num-gpu-blocks-override", "16", "--block-size", "8", "--disable-log-stats",
         "--replica-dead-timeout-s", "4"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    family: list = []
    try:
        wait_until_healthy(proc, port, lambda: (log.seek(0), log.read())[1], WAIT_S)
        family = psutil.Process(proc.pid).children(recursive=True)
        raylets = [p for p in family if "raylet" in p.name()]
        assert raylets, [p.name() for p in family]
        for p in raylets:
            p.kill()  # the node's agent: every replica goes with it
        rc = proc.wait(timeout=WAIT_S)
        log.seek(0)
        out = log.read()
        assert rc != 0, out
        assert "no data-parallel replica has been healthy for 4 s" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for p in family:  # Ray processes the server started and left behind
            try:
                p.kill()
            except psutil.Error:
                pass
        log.close()

"""Where the decode matmuls run (jpaged/runner/linears.py) and the step's compile options."""

from __future__ import annotations

import logging

import jax.numpy as jnp
from tiny_models import tiny_spec

from jpaged.runner.linears import rope_in_kernel, select_linears
from jpaged.runner.model_runner import (
    COMMAND_BUFFER_OPTIONS,
    EAGER_OPTIONS,
    _accepts,
    step_compiler_options,
)


def test_a_model_the_kernels_cannot_take_keeps_xla_and_says_why(caplog):
    spec = tiny_spec(intermediate_size=100)  # 100 = 4 x 25: no tile >= 16 divides it
    with caplog.at_level(logging.WARNING, logger="jpaged.runner"):
        assert select_linears("pallas", "gpu", spec, jnp.bfloat16) is None
    assert "output size 100" in caplog.text
    assert select_linears("pallas", "gpu", tiny_spec(), jnp.bfloat16) is not None
    assert select_linears("pallas+tp2", "cuda", tiny_spec(), jnp.bfloat16) is not None
    assert select_linears("xla", "gpu", tiny_spec(), jnp.bfloat16) is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jpaged.runner"):  # fp8 weights: not yet
        assert select_linears("pallas", "gpu", tiny_spec(), jnp.float8_e4m3fn) is None
    assert "weight dtype float8_e4m3fn" in caplog.text


def test_the_kv_write_joins_the_qkv_launch_only_where_rope_does():
    assert rope_in_kernel(tiny_spec(head_dim=32))
    assert not rope_in_kernel(tiny_spec())  # head_dim 16: half a head is 8 columns
    assert not rope_in_kernel(tiny_spec(head_dim=32, qk_norm=True))  # the norm comes between


def test_gpu_steps_compile_into_command_buffers():
    """On a GPU platform the step gets the command-buffer options (this XLA accepts them);
    elsewhere only the memory-limit option."""
    cpu = step_compiler_options("cpu")
    assert "xla_gpu_enable_command_buffer" not in cpu
    gpu = step_compiler_options("cuda")
    assert gpu == {**cpu, **COMMAND_BUFFER_OPTIONS}
    assert "WHILE" in gpu["xla_gpu_enable_command_buffer"].split(",")
    # vLLM's enforce_eager: no command buffers on a GPU (XLA's default types included); this
    # XLA takes the option; nothing changes on a CPU.
    eager = step_compiler_options("cuda", eager=True)
    assert eager == {**cpu, **EAGER_OPTIONS} and eager["xla_gpu_enable_command_buffer"] == ""
    assert step_compiler_options("cpu", eager=True) == cpu
    assert _accepts(tuple(sorted(EAGER_OPTIONS.items()))) is None

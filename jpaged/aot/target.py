"""A described GPU for deviceless compiles: the H200 target, its topology, the lowering context.

With a CUDA plugin installed (`pip install "jax[cuda12]"` or `"jax[cuda13]"`) and
`JAX_PLATFORMS=cpu` (so that jax starts although no GPU answers), XLA compiles for a GPU
described by a target config: `topologies.get_topology_desc` returns abstract devices, inputs
carry shardings on them, and `jit(...).trace(...).lower().compile()` runs XLA's GPU pipeline,
Triton and ptxas for sm_90a. Where jax versions differ:

* jax 0.10: lowering for the abstract devices needs nothing more.
* jax >= 0.11: lowering must run inside `jax.sharding.use_abstract_mesh` over those devices
  (otherwise "lowering for an abstract GPU device" is refused), and the PTX is dumped only with
  `xla_gpu_dump_llvmir` (see `buffers.dump_options`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

TARGET_NAME = "NVIDIA H200 (sm_90a, deviceless)"
# HBM3e bandwidth of the H200 SXM (NVIDIA's spec sheet: 4.8 TB/s), the figure a step's predicted
# time divides by; sustained copies reach about 80% of it (HBM_REALISTIC_FRACTION).
H200_HBM_BYTES_PER_S = 4.8e12
HBM_REALISTIC_FRACTION = 0.8


def h200_target_config() -> str:
    """The H200 target config (text proto) shipped in this package."""
    return resources.files("jpaged.aot").joinpath("h200.txtpb").read_text()


def target_field(name: str, config: str | None = None) -> int:
    """An integer field of the target config's gpu_device_info, e.g. device_memory_size."""
    m = re.search(rf"\b{name}:\s*(\d+)", config or h200_target_config())
    if not m:
        raise KeyError(f"{name} is not in the GPU target config")
    return int(m.group(1))


def jax_version() -> tuple[int, int]:
    """(major, minor) of the running jax."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def cuda_plugin_error() -> str | None:
    """Why no deviceless CUDA compile can run here, or None if it can."""
    try:
        from jax.experimental import topologies

        topologies.get_topology_desc(platform="cuda", target_config=h200_target_config(),
                                     topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - any failure means: not available
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"no CUDA compiler plugin for jax {jax.__version__} ({first}); install one "
                "beside jax, e.g. pip install \"jax[cuda12]==<jax version>\" (make gpu-aot does)")
    return None


@dataclass(frozen=True)
class GpuTarget:
    """Abstract GPU devices of one described machine, for lowering and compiling."""

    devices: tuple[Any, ...]
    config: str

    @property
    def device_memory_bytes(self) -> int:
        """Memory of one device, from the target config."""
        return target_field("device_memory_size", self.config)

    def mesh(self, axis: str = "tp") -> Mesh:
        """A 1-D mesh over the devices."""
        return Mesh(np.array(self.devices), (axis,))

    @contextlib.contextmanager
    def lowering(self) -> Iterator[None]:
        """The context a lowering for these devices needs (see the module doc)."""
        if jax_version() >= (0, 11):
            with jax.sharding.use_abstract_mesh(self.mesh().abstract_mesh):
                yield
        else:
            yield


def h200_target(num_devices: int = 1) -> GpuTarget:
    """`num_devices` abstract H200s of one host (topology 1x1xN)."""
    from jax.experimental import topologies

    config = h200_target_config()
    topo = topologies.get_topology_desc(platform="cuda", target_config=config,
                                        topology=f"1x1x{num_devices}")
    if len(topo.devices) != num_devices:
        raise RuntimeError(f"asked for {num_devices} abstract GPUs, got {len(topo.devices)}")
    return GpuTarget(tuple(topo.devices), config)

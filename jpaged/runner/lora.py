"""The device's LoRA slots: up to `max_loras` adapters on the device, loaded as steps need them.

Every projection that LoRA can adapt gets one A [L, in, S*R] and one B [L, S*R, out] array in
the model's dtype (S = max_loras slots, R = max_lora_rank; models/lora.py, `LoraBatch`). An
adapter of rank r <= R fills its slot's first r columns (rows) and zeros the rest, so a slot
once reused holds nothing of its previous adapter. The arrays keep their shapes for the
engine's life: loading an adapter recompiles nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.runner.kv_cache import zeros_as
from models.config import ModelSpec
from models.lora import LoraAdapter, lora_module_shapes

logger = logging.getLogger(__name__)


def _slot_shapes(spec: ModelSpec, width: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The A and B shapes of every adaptable projection for slots `width` columns wide."""
    layers = spec.num_layers
    return {m: ((layers, n_in, width), (layers, width, n_out))
            for m, (n_in, n_out) in lora_module_shapes(spec).items()}


@partial(jax.jit, donate_argnums=(0,))
def _write_slot(weights: dict[str, tuple[jax.Array, jax.Array]],
                new: dict[str, tuple[jax.Array, jax.Array]], start: jax.Array
                ) -> dict[str, tuple[jax.Array, jax.Array]]:
    """`weights` with each module's slot columns [start, start + R) of A and rows of B
    replaced by `new`'s (donated: the old arrays' memory is reused)."""
    out = {}
    for m, (a, b) in weights.items():
        na, nb = new[m]
        out[m] = (jax.lax.dynamic_update_slice(a, na, (0, 0, start)),
                  jax.lax.dynamic_update_slice(b, nb, (0, start, 0)))
    return out


class LoraSlots:
    """`num_slots` adapter slots of rank `rank` on the device, and which adapter holds each."""

    @classmethod
    def abstract(cls, spec: ModelSpec, num_slots: int, rank: int, dtype: Any,
                 sharding: Any = None) -> LoraSlots:
        """Slots whose arrays are ShapeDtypeStructs (a deviceless compile; nothing allocated,
        nothing can be loaded)."""
        slots = cls.__new__(cls)
        slots.spec, slots.num_slots, slots.rank = spec, num_slots, rank
        slots.dtype = jnp.dtype(dtype)
        slots.weights = {m: tuple(jax.ShapeDtypeStruct(s, slots.dtype, sharding=sharding)
                                  for s in shapes)
                         for m, shapes in _slot_shapes(spec, num_slots * rank).items()}
        slots._slot_of, slots.num_loads = OrderedDict(), 0
        return slots

    def __init__(self, spec: ModelSpec, num_slots: int, rank: int, dtype: Any,
                 place: Callable[[jax.Array], jax.Array] | None = None) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.rank = rank
        self.dtype = jnp.dtype(dtype)
        self._place = place or (lambda x: x)
        self.weights: dict[str, tuple[jax.Array, jax.Array]] = {
            m: tuple(self._place(jnp.zeros(s, self.dtype)) for s in shapes)
            for m, shapes in _slot_shapes(spec, num_slots * rank).items()}
        # Invariant: slot s's columns of A (rows of B) hold the adapter keyed k where
        # _slot_of[k] == s, zero-padded to `rank`; a slot no key maps to holds zeros or an
        # adapter no step will use again. Keys least recently used first.
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        self.num_loads = 0  # adapters written into a slot (a reload counts again)

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot's arrays."""
        return sum(x.size * x.dtype.itemsize for pair in self.weights.values() for x in pair)

    def loaded(self) -> list[str]:
        """Names of the adapters in a slot now."""
        return [key.rsplit("@", 1)[0] for key in self._slot_of]

    def _padded(self, adapter: LoraAdapter) -> dict[str, tuple[jax.Array, jax.Array]]:
        """The adapter's arrays for one slot: [L, in, R] and [L, R, out], zeros where absent."""
        out = {}
        layers, r = self.spec.num_layers, adapter.rank
        for m, (n_in, n_out) in lora_module_shapes(self.spec).items():
            a = np.zeros((layers, n_in, self.rank), np.float32)
            b = np.zeros((layers, self.rank, n_out), np.float32)
            if m in adapter.weights:
                a[:, :, :r], b[:, :r, :] = adapter.weights[m]
            out[m] = (self._place(jnp.asarray(a, self.dtype)),
                      self._place(jnp.asarray(b, self.dtype)))
        return out

    def assign(self, adapters: Sequence[LoraAdapter]) -> dict[str, int]:
        """A slot for each adapter of a step, by key (loading those not in one into the slots
        least recently used by others); {key: slot}. ValueError past `num_slots` adapters
        (the scheduler admits at most that many at once)."""
        names = {a.key: a for a in adapters}
        if len(names) > self.num_slots:
            raise ValueError(f"a step uses {len(names)} LoRA adapters but max_loras is "
                             f"{self.num_slots}")
        for name, adapter in names.items():
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not need
                victim = next(n for n in self._slot_of if n not in names)
                slot = self._slot_of.pop(victim)
            self.weights = _write_slot(self.weights, self._padded(adapter),
                                       jnp.int32(slot * self.rank))
            self._slot_of[name] = slot
            self.num_loads += 1
            logger.debug("LoRA adapter %r loaded into slot %d", name, slot)
        return {name: self._slot_of[name] for name in names}

    def clear(self) -> None:
        """Zeroed slots, none holding an adapter (after their arrays were dropped)."""
        self.weights = jax.tree.map(zeros_as, self.weights)
        self._slot_of.clear()

    def step_slots(self, requests: Sequence[Any]) -> np.ndarray:
        """Each request's slot (-1: the base model) for one step, loading the adapters the
        requests hold (`Request.lora_adapter`) as needed."""
        adapters = [r.lora_adapter for r in requests if r.lora_adapter is not None]
        slot_of = self.assign(adapters) if adapters else {}
        return np.asarray([-1 if r.lora_adapter is None else slot_of[r.lora_adapter.key]
                           for r in requests], np.int32)

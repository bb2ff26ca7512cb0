"""A ZeRO stage-0 checkpoint (issue #17): its checkpoint index, one ``dense`` domain whose masters are
the fp32 copies the optimizer holds (or the module's weights when it holds none)."""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.states import StateCache
from ...format.index_models import CheckpointIndex, Coordinate
from ..layout.masters import stage0_masters
from .index_builder import IndexBuilder, LiveMasters, StoredIn, files_of


def describe(
    folder: Path, states: StateCache, hash_algorithm: str | None = None, live: LiveMasters | None = None
) -> CheckpointIndex:
    """The index of a ZeRO stage-0 checkpoint: one ``dense`` domain; ``live``: the engine's masters (save hook)."""
    b = IndexBuilder(folder, states, hash_algorithm, live)
    if live is None:
        masters = list(stage0_masters(folder, states).values())
        optimizer = b.model.get("optimizer")
        # FP16_UnfusedOptimizer's fp32_groups or FP16_Optimizer's fp32_groups_flat: masters apart from the weights
        held = isinstance(optimizer, dict) and ("fp32_groups" in optimizer or "fp32_groups_flat" in optimizer)
        stored_in: StoredIn = "model_states" if held else "module"
    else:
        masters, stored_in = list(live.masters.values()), live.stored_in
    domain = b.domain(
        "dense",
        Coordinate(pipeline=0, tensor=0),
        "data_parallel",
        masters,
        stored_in,
        files_of(b, masters, []),
    )
    domain.manifest.buffers = b.buffers()
    return b.index("zero", [domain])

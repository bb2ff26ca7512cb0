"""A ZeRO stage-0 checkpoint (issue #17): its checkpoint index, one ``dense`` domain whose masters are
the fp32 copies the optimizer holds (or the module's weights when it holds none).

An AutoTP job at stage 0 saves one such file per tensor rank (``mp_rank_XX_model_states.pt``, every data rank the
same): one domain per tensor rank (``pp0-tpXX``), each its own file's masters, placed in the whole model by the
``affine_map`` its model states record, as a ZeRO AutoTP checkpoint's (``model_parallel``), its ties (one tensor under
two names) each domain's aliases, as a data-parallel stage-0 checkpoint's."""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.states import StateCache
from ...errors import UnsupportedCheckpoint
from ...format.index_models import CheckpointIndex, Coordinate
from ...format.models import Alias, FrozenParam
from ...format.partition import frozen_params
from ..layout.masters import MODEL_FILE, stage0_frozen, stage0_masters
from ..layout.parallel_files import degrees_of, scan_parallel
from ..layout.stage0_names import stage0_ties
from .index_builder import IndexBuilder, LiveMasters, StoredIn, files_of
from .index_extras import with_extras


def describe(
    folder: Path, states: StateCache, hash_algorithm: str | None = None, live: LiveMasters | None = None
) -> CheckpointIndex:
    """The index of a ZeRO stage-0 checkpoint: one ``dense`` domain; ``live``: the engine's masters (save hook)."""
    files = scan_parallel(folder) if live is None else None
    if files is not None and len(files.by_mp_rank) > 1:
        return _tensor_parallel(folder, files, states, hash_algorithm)
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
    if live is None:
        model_file = MODEL_FILE if b.model_file is None else b.model_file
        domain.manifest.frozen = _frozen(folder, states, model_file)
        domain.manifest.aliases = _aliases(states.state(folder / model_file), masters, domain.manifest.frozen)
    return b.index("zero", [domain])


def _aliases(model: dict, masters: list, frozen: list[FrozenParam]) -> list[Alias]:
    """The ties of the module (``stage0_names.stage0_ties``): each alias its owner's (trained or frozen)."""
    shapes = {m.name: list(m.shape) for m in masters} | {f.name: list(f.shape) for f in frozen}
    return [Alias(name=alias, owner=owner, shape=shapes[owner]) for alias, owner in stage0_ties(model).items()]


def _frozen(folder: Path, states: StateCache, model_file: str) -> list[FrozenParam]:
    """The module's parameters that hold no master (``masters.stage0_frozen``), as saved in the module."""
    module = states.state(folder / model_file)["module"]
    names = stage0_frozen(folder, states, model_file)
    refs = [module[n] for n in names]
    return frozen_params(names, [tuple(r.shape) for r in refs], [r.dtype for r in refs], "module")


def _stored_in(model: dict) -> StoredIn:
    """FP16_UnfusedOptimizer's fp32_groups or FP16_Optimizer's fp32_groups_flat: masters apart from the weights."""
    optimizer = model.get("optimizer")
    held = isinstance(optimizer, dict) and ("fp32_groups" in optimizer or "fp32_groups_flat" in optimizer)
    return "model_states" if held else "module"


def _tensor_parallel(folder: Path, files, states: StateCache, hash_algorithm: str | None) -> CheckpointIndex:
    """One domain per tensor rank of an AutoTP job at stage 0, its parameters placed by the affine_map."""
    from .model_parallel import tensor_view

    degrees = degrees_of(files, states)
    if degrees.pipeline != 1 or degrees.tensor != len(files.by_mp_rank):
        raise UnsupportedCheckpoint(
            f"stage-0 model states of {len(files.by_mp_rank)} model-parallel ranks, pipeline {degrees.pipeline} x "
            f"tensor {degrees.tensor} recorded ({degrees.source})",
            "AutoTP checkpoints at stage 0 (one model-states file per tensor rank) are described",
            str(folder),
        )
    b = IndexBuilder(folder, states, hash_algorithm)
    domains = []
    for mp, shards in sorted(files.by_mp_rank.items()):
        model = shards.model_files[min(shards.model_files)].name
        masters = list(stage0_masters(folder, states, model).values())
        stored_in = _stored_in(states.state(folder / model))
        coordinate = Coordinate(pipeline=0, tensor=mp)
        listed = files_of(b, masters, [], model=model)
        domain = b.domain(f"pp0-tp{mp}", coordinate, "data_parallel", masters, stored_in, listed, add_parameters=False)
        domain.manifest.buffers = b.buffers()  # AutoTP leaves buffers whole: every tensor rank saves the same
        domain.manifest.frozen = _frozen(folder, states, model)  # placed by the affine_map as trainable ones
        # a tie as a data-parallel one's; tensor_view takes a weight AutoTP left whole only (model_parallel._check_ties)
        domain.manifest.aliases = _aliases(states.state(folder / model), masters, domain.manifest.frozen)
        domain.manifest.layout.tensor_parallel_size = degrees.tensor
        domains.append(domain)
    index = b.index("zero", domains)
    index.parameters = tensor_view(files, states, domains, degrees.tensor)
    index.topology.degrees.tensor = degrees.tensor
    index.topology.model_parallel_size = degrees.model_parallel
    index.topology.degrees_source = degrees.source
    return with_extras(index, folder, states)  # frozen parameters placed by the affine_map (a 1.1 index if any)

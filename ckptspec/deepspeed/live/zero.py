"""Manifests from a live DeepSpeed engine.

The layout is read from the optimizer objects themselves (flat-buffer offsets,
alignment paddings, round-robin order, partition sizes, stage-3 sub-groups), not
re-derived from the config. No collective call is made: every value read here is
already present on each rank, so ``manifest_from_engine`` may be called on any
subset of ranks without deadlock.

Imports torch and DeepSpeed only when called.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter

from ..._version import __version__
from ...errors import UnsupportedEngine
from ...format.codec import gc_paused
from ...format.dtypes import Dtype
from ...format.models import ExcludedParam, Layout, Manifest, Producer
from ...format.version import FORMAT_NAME, FORMAT_VERSION
from .groups import (
    flat_groups_bf16_optimizer,
    flat_groups_stage12,
    is_bf16_optimizer,
    per_param_groups_stage3,
)
from .refusals import refuse_unsaveable
from .state import (
    aliases_of_engine,
    buffers_of_engine,
    frozen_of_engine,
    master_dtype_of_engine,
    optimizer_of_engine,
    save_of_engine,
)
from .walk import walk_module

_NAME = attrgetter("name")


def _check_supported(engine) -> None:
    refuse_unsaveable(engine)
    if getattr(engine, "has_moe_layers", False):
        raise UnsupportedEngine("MoE engines are described by a checkpoint index, not a manifest 1.x")
    if engine.mp_world_size > 1 or type(engine).__name__ == "PipelineEngine":
        raise UnsupportedEngine(
            "tensor- or pipeline-parallel engines are described by a checkpoint index "
            "(ckptspec.deepspeed.index_from_engine)"
        )


def manifest_from_engine(engine, *, exclude_frozen_parameters: bool = False) -> Manifest:
    """Describe ``engine``'s checkpoint layout (no ``files``: see ``describe_files``).

    Arguments:
        engine: a ``deepspeed.DeepSpeedEngine`` after ``deepspeed.initialize``.
        exclude_frozen_parameters: the value passed to ``engine.save_checkpoint``.

    Returns:
        The manifest; identical on every rank. Makes no collective call.

    Raises:
        UnsupportedEngine: MoE, tensor or pipeline parallelism, ZeRO stage 0.
    """
    _check_supported(engine)
    return engine_layout(engine, exclude_frozen_parameters)


def engine_layout(engine, exclude_frozen_parameters: bool = False) -> Manifest:
    """The manifest of the ZeRO data-parallel group ``engine`` belongs to (no refusal of model
    parallelism: a checkpoint index embeds one per tensor/pipeline coordinate, live/model_parallel.py)."""
    with gc_paused():  # ~1M acyclic objects made: see codec.gc_paused
        return _engine_layout(engine, exclude_frozen_parameters)


def _engine_layout(engine, exclude_frozen_parameters: bool) -> Manifest:
    import deepspeed

    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    walk = walk_module(engine.module)
    # A tied param is named by its first name, as DeepSpeed names it (its other names are aliases).
    names = walk.names
    if stage == 3:
        groups = per_param_groups_stage3(engine, names)
    elif is_bf16_optimizer(opt):
        groups = flat_groups_bf16_optimizer(engine, names)
    elif stage in (1, 2):
        groups = flat_groups_stage12(engine, names)
    else:
        raise UnsupportedEngine(
            f"ZeRO stage 0 with {type(opt).__name__} is described by a checkpoint index, not a manifest 1.x"
        )
    trainable = set(map(_NAME, chain.from_iterable(g.params for g in groups)))  # in C: 100k params
    frozen_stage = 1 if is_bf16_optimizer(opt) else stage
    aliases = aliases_of_engine(walk)
    alias_names = {a.name for a in aliases}
    frozen = [
        f
        for f in frozen_of_engine(walk, trainable, frozen_stage, exclude_frozen_parameters)
        if f.name not in alias_names
    ]
    excluded = []
    if exclude_frozen_parameters:
        excluded = [
            ExcludedParam(name=names[id(p)], reason="exclude_frozen_parameters")
            for p in walk.params
            if names[id(p)] not in trainable
        ]
    model_dtype: Dtype = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
    master = master_dtype_of_engine(engine, stage)
    zero_cfg = engine._config.zero_config
    layout = Layout(
        zero_stage=stage,
        world_size=engine.dp_world_size,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        model_parallel_size=engine.mp_world_size,
        model_dtype=model_dtype,
        master_dtype=master,
        round_robin=bool(getattr(opt, "round_robin_gradients", False)),
        parameter_alignment=bool(getattr(opt, "parameter_alignment", False)),
        tail_padding_saved=is_bf16_optimizer(opt),
        byte_order="little",
        optimizer=type(opt).__name__,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    if stage == 3:
        layout.sub_group_size = int(zero_cfg.sub_group_size)
    manifest = Manifest(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        producer=Producer(
            tool="ckptspec", tool_version=__version__, framework="deepspeed", framework_version=deepspeed.__version__
        ),
        layout=layout,
        groups=groups,
        frozen=frozen,
        buffers=buffers_of_engine(engine, walk),
        aliases=aliases,
        excluded=excluded,
        files=[],
        save=save_of_engine(engine),
    )
    if (optimizer := optimizer_of_engine(engine, stage)) is not None:
        manifest.optimizer = optimizer
    return manifest

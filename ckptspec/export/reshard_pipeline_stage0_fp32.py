"""``ckptspec reshard --stage 0`` of an fp32 PipelineModule checkpoint: what an fp32 pipeline job at ZeRO stage 0 saves.

DeepSpeed 0.19.8's fp32 pipeline at stage 0 steps the client torch optimizer itself (no BF16_Optimizer, no ZeRO):
it writes no optimizer-state files; each stage's ``mp_rank_<s>_model_states.pt`` is a ZeRO-1 pipeline stage's with
``optimizer`` the torch optimizer's ``state_dict()`` (its state numbered over the stage's trainable parameters in
module order, each with its own ``step``, ``exp_avg``, ``exp_avg_sq``; ``param_groups`` as saved, each listing its
numbers), ``param_shapes``/``shared_params``/frozen entries None, ``dp_world_size`` the target's data degree, the
``ds_config`` at stage 0; every data rank holds the same, so one file per stage whatever the data degree. The layer
files (the fp32 weights, which are the masters) are as saved.

Each stage is written from the source stage's masters and moments (``reshard_stage0.torch_optimizer``, the dense
stage-0 writer's): a ZeRO-1 pipeline's partitions, or a stage-0 fp32 pipeline's own state at another data degree;
at another number of stages the restage of ``reshard_pipeline_stage0`` runs first (``RestagedStage0Write``).
``engine.load_checkpoint`` loads it as it loads DeepSpeed's own save.

An fp16 pipeline's stage-0 job wraps that torch optimizer in ``FP16_UnfusedOptimizer``: ``optimizer`` is then its
``state_dict()`` (``loss_scale``: the source stage's dynamic loss-scale entries as saved, then the torch state as
``optimizer_state_dict`` and the fp32 masters as ``fp32_groups``), the layer files' fp16 weights as saved. Only from
such a source at the same stages (another data degree): its FP16_UnfusedOptimizer saves every loss-scale counter the
target's holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..deepspeed.describe.scalars import plain_value
from ..format.models import Manifest
from . import ds_pickle
from .arrays import ShardReader
from .model_plan import ReconstructionPlan
from .optimizer_state import OptimizerStatePlan
from .reshard_files import lazy_reader, tensor_reader
from .reshard_layout import natural_groups
from .reshard_source import SourceOptimizer
from .reshard_stage0 import stage0_model_states, torch_optimizer

# FP16_UnfusedOptimizer.state_dict()'s loss-scale entries (runtime/fp16/unfused_optimizer.py), in its order
UNFUSED_SCALE_KEYS = (
    "dynamic_loss_scale",
    "cur_scale",
    "cur_iter",
    "last_overflow_iter",
    "scale_factor",
    "scale_window",
)


def unfused_loss_scale(model_state: dict) -> dict[str, Any]:
    """A stage's FP16_UnfusedOptimizer loss-scale entries as saved (a static scale saves the first three only)."""
    wrapper = model_state["optimizer"]
    return {key: plain_value(wrapper[key]) for key in UNFUSED_SCALE_KEYS if key in wrapper}


@dataclass
class Fp32StageWrite:
    """One pipeline stage written as an fp32 stage-0 pipeline job saves it: its model states only."""

    manifest: Manifest  # the source stage's domain manifest
    plan: ReconstructionPlan  # its fp32 masters
    state_plan: OptimizerStatePlan  # their moments
    source: SourceOptimizer  # the param groups and steps (``path``: the file its scalars are read from)
    model_file: Path  # the source stage's model states
    data: int  # the target's data-parallel degree
    mp_rank: int  # the stage
    loss_scale: dict[str, Any] | None = None  # an fp16 stage's FP16_UnfusedOptimizer loss-scale entries, as saved

    zero_stage = 0

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        assert self.source.path is not None
        with ShardReader() as files:
            read_optim = tensor_reader(self.source.path, states, files)  # the scalars (step): read small
            read_model = lazy_reader(self.model_file, states, files)
            groups = [(g, [p.name for p in params]) for g, params in natural_groups(self.manifest)]
            sources, moments = self.plan.sources, self.state_plan.sources
            masters, torch_state = torch_optimizer(
                groups, sources, self.state_plan.states, moments, self.source, read_optim, files
            )
            optimizer: Any = torch_state
            if self.loss_scale is not None:  # FP16_UnfusedOptimizer.state_dict()'s order
                optimizer = {**self.loss_scale, "optimizer_state_dict": torch_state, "fp32_groups": masters}
            model_state = states.state(self.model_file)
            doc = stage0_model_states(model_state, model_state.get("module"), optimizer, self.data, read_model)
            path = tag_dir / f"mp_rank_{self.mp_rank:02d}_model_states.pt"
            ds_pickle.save_streamed(doc, path, shapes_as_tuples=True)
        return [path]

"""``ckptspec reshard --stage 0`` of a MoE checkpoint (``deepspeed.moe.layer.MoE``, ZeRO stage 0, 1 or 2): the files
a stage-0 MoE job of the target world size and expert-parallel degree E saves (DeepSpeed 0.19.8's
``engine._save_checkpoint`` and ``_save_moe_checkpoint`` with ZeRO off). Every rank holds the dense model and its
expert-parallel rank's experts whole, so the world size changes only the recorded ``dp_world_size``.

- ``expp_rank_<e>_mp_rank_00_optim_states.pt`` for each expert-parallel rank e < E: ``{"optimizer": ...}``, that
  rank's optimizer ``state_dict()`` (``reshard_stage0.stage0_wrapper``: fp32, the client torch optimizer's;
  bf16/fp16, FP16_UnfusedOptimizer's with ``fp32_groups``) over its two groups, the dense parameters then its
  experts' (``reshard_moe``'s parts: experts e*L .. e*L+L-1 under local names), each in model order
  (``reshard_stage0.torch_optimizer``), the expert group named ``ep_size_E``. A stage-0 job loads its
  expert-parallel rank's file.
- ``mp_rank_00_model_states.pt``: the dense module (``reshard_stage0.stage0_module``: fp32, the dense masters), as
  ``optimizer`` expert-parallel rank 0's state dict (what rank 0 saves beside its file), the rest as a stage-0 job
  saves it (``reshard_stage0.stage0_model_states``).
- the expert files (one per global expert): copied as saved by the caller (in fp32 the module's weights, which are
  the masters at stage 0 and the masters' copies at ZeRO-1/2).

What cannot be described at stage 0 (tied or frozen dense parameters, FusedAdam's param groups) is refused by
``reshard_stage0.refuse_stage0`` in ``reshard_moe.plan_moe``, before anything is written (CK410).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from . import ds_pickle
from .arrays import ShardReader
from .reshard_files import lazy_reader, tensor_reader
from .reshard_moe import MoePart, MoeTarget, expert_groups_named
from .reshard_stage0 import MODEL_FILE, stage0_model_states, stage0_module, stage0_wrapper, torch_optimizer


def write_moe_stage0(moe: MoeTarget, states: StateCache, tag_dir: Path, src_dir: Path) -> list[Path]:
    """Each expert-parallel rank's optimizer file, then the model states (the expert files are the caller's)."""
    source, found = moe.source, moe.dense_domain.manifest
    assert source.path is not None  # set by plan_moe
    model = src_dir / next(p for p in moe.dense_domain.file_ranks if "model_states" in p)
    model_state = states.state(model)
    written = []
    with ShardReader() as files:
        read = tensor_reader(source.path, states, files)  # the scalars only (step): read small
        read_model = lazy_reader(model, states, files)  # nothing read until written

        def optimizer(part: MoePart) -> Any:
            """Rank ``part``'s optimizer state dict: the dense group, then its experts'."""
            masters = {**moe.dense.masters, **part.masters}
            held = {**moe.dense.states, **part.states}
            groups = [*moe.dense.natural, *part.natural]
            fp32_groups, torch_state = torch_optimizer(groups, masters, held, part.moments, source, read, files)
            expert_groups_named(torch_state["param_groups"], len(moe.experts))
            return stage0_wrapper(found, source.osd, model_state, fp32_groups, torch_state)

        for e, part in enumerate(moe.experts):
            path = tag_dir / f"expp_rank_{e}_{MODEL_FILE.replace('_model_states', '_optim_states')}"
            ds_pickle.save_streamed({"optimizer": optimizer(part)}, path)
            written.append(path)
        module = stage0_module(found, moe.dense.masters, model_state["module"], read_model, files)
        doc = stage0_model_states(model_state, module, optimizer(moe.experts[0]), moe.world_size, read_model)
        ds_pickle.save_streamed(doc, tag_dir / MODEL_FILE, shapes_as_tuples=True)
        written.append(tag_dir / MODEL_FILE)
    return written

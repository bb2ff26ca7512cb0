"""``ckptspec export-universal`` of a MoE checkpoint at ZeRO stage 0, 1 or 2 (DeepSpeed's ``deepspeed.moe.layer.MoE``),
for a job of the same expert-parallel degree and experts per rank.

DeepSpeed 0.19.8's universal load reads every parameter from ``zero/<its name in the module>``
(``runtime/base_optimizer.py`` ``load_hp_checkpoint_state_from_checkpoint_dir``: ``self.param_names[lp]``). A native
expert's name there is its *local* one (``...deepspeed_experts.<j>...``, j < L experts per rank): the same on every
expert-parallel rank, for expert ``e*L + j`` on rank e. Its loader takes a file whose entry ``is_expert_param`` is
set as the stack of ``ep_num_experts`` tensors on a new axis 0 and keeps the one of its own expert-parallel rank
(``checkpoint/universal_checkpoint.py`` ``load_hp_checkpoint_state``, ``ep_size > 1``). So each local name's files
hold, stacked, the E experts that name stands for on expert-parallel ranks 0 .. E-1, with ``ep_num_experts`` E; the
dense parameters are written as any (``universal.py``). A job of another expert degree or number of experts per rank
fails loudly in that loader (measured with an ep1 job: its numel assertion, a missing local name), never loading
another expert's values.

The values are those ``reshard`` moves (``reshard_moe.plan_moe``): a stage-0 source's masters and moments where
the checkpoint index locates them, its param groups, step and loss scale from its stage-0 optimizer, read as the
ZeRO-1 job of the same expert-parallel degree reads them.

DeepSpeed's own ``ds_to_universal`` fails on these checkpoints (``RuntimeError: shape ... is invalid``; at stage 0
``KeyError: 'optimizer_state_dict'``).
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan, TensorSource
from .optimizer_state import OptimizerStatePlan
from .reshard_moe import expert_ranks, plan_moe

# DeepSpeed 0.19.8's keys of an expert parameter's universal file (checkpoint/constants.py)
EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS = "is_expert_param", "ep_num_experts"


def moe_parts(
    index: CheckpointIndex, src_dir: Path, plans: dict[str, ReconstructionPlan], states: StateCache
) -> tuple[list[tuple], dict[str, dict]]:
    """``universal.write_folder``'s parts of the MoE checkpoint ``index`` (the dense group; each local expert name's
    experts stacked) and the entries of the expert parameters' files. CK410 for what is not written."""
    dense = next(d for d in index.domains if d.coordinate.expert is None)
    # the source's own layout (its refusals); a stage-0 one (domains of size 1) as the ZeRO-1 job of its expert
    # degree, one rank per expert-parallel rank
    ep = index.topology.degrees.expert
    stage0 = dense.configured_zero_stage == 0
    moe = plan_moe(index, src_dir, plans, states, ep if stage0 else dense.size, 1 if stage0 else None)
    dense_part = (dense.manifest, plans[dense.id], masters_state_plan(src_dir, dense, states), moe.source)
    first = next(d for d in index.domains if d.coordinate.expert == 0)
    template = first.manifest.model_copy(deep=True)  # expert rank 0's group under the local names
    (group,) = template.groups  # one expert group (plan_moe's refusals)
    by_name = {p.name: p for p in group.params}
    names = expert_ranks(index, ep)[0]  # local name -> the global name it stands for on expert-parallel rank 0
    local_names = list(names)
    group.params = [by_name[names[n]].model_copy(update={"name": n}) for n in local_names]
    sources: dict[str, TensorSource] = {}
    moments: dict[str, TensorSource] = {}
    keys: dict[str, dict[str, str]] = {}
    for n in local_names:
        parts = [part.masters[n] for part in moe.experts]
        sources[n] = _stacked(n, parts, "trainable")
        keys[n] = {}
        for key in sorted(moe.experts[0].states[n]):
            stacked = [part.moments[part.states[n][key]] for part in moe.experts]
            keys[n][key] = f"{n}.{key}"
            moments[f"{n}.{key}"] = _stacked(f"{n}.{key}", stacked, "state")
    plan = ReconstructionPlan(src_dir, sources, {}, local_names, manifest=template)
    expert_part = (template, plan, OptimizerStatePlan(moments, keys, {}), moe.source)
    entries = {n: {EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: ep} for n in local_names}
    return [dense_part, expert_part], entries


def _stacked(name: str, parts: list[TensorSource], role: str) -> TensorSource:
    """The tensors of ``parts`` (one shape and dtype) stacked on a new axis 0: their bytes one after the other."""
    shape, dtype = parts[0].shape, parts[0].dtype
    if any(p.shape != shape or p.dtype != dtype for p in parts):
        raise ReshardUnsupported(f"{name}: the experts it names differ in shape or dtype", "resume at the same layout")
    return TensorSource(name, (len(parts), *shape), dtype, [s for p in parts for s in p.segments], role)

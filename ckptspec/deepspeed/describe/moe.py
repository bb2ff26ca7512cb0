"""The checkpoint index of a native MoE DeepSpeed checkpoint (``deepspeed.moe.layer.MoE``, issue #17).

Domains: ``dense`` (the non-expert parameters, ``data_parallel``) and one domain per expert-parallel
rank ``e`` (``expert:ep_size_<ep>:ep<e>``, process group ``expert_data_parallel:ep_size_<ep>``,
coordinate ``expert`` = e) holding the global experts ``e * L .. e * L + L - 1``. At stage 1/2 the
dense domain spans every ``zero_pp_rank`` file (``partition_count[0]``) and expert domain ``e`` the
files of its expert-data-parallel group (``partition_count[1]``); at stage 0 every domain has size 1
and the masters are in the module, the expert files or the ``expp_rank`` files (``masters.py``).
Every expert file is in ``expert_files`` with the expert-parallel rank that wrote it.
"""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import CheckpointInvalid, UnsupportedCheckpoint
from ...findings import finding
from ...format.index_models import CheckpointIndex, Coordinate, ExpertFile
from ..layout.masters import EXPP_RE, MODEL_FILE, list_expert_files, stage0_masters, stage0_replicas
from ..layout.moe_masters import moe_zero_masters
from ..layout.names import OPTIM_RE
from .index_builder import IndexBuilder, LiveMasters, files_of

_HINT = "the expert layout of this MoE checkpoint cannot be derived from its files; it is not described"


def _refuse_missing_experts(model: dict, experts: list, n_experts: int, per_rank: int, where: str) -> None:
    """CK240 for each expert file DeepSpeed wrote that is not here: one per expert of every MoE layer
    (``num_experts``, one count per layer, in the model states), ``layer_<L>_expert_<E>_...``."""
    counts = model.get("num_experts")
    layers = (
        dict(enumerate(counts))
        if isinstance(counts, list) and all(isinstance(n, int) for n in counts)
        else {layer: n_experts for layer, _, _ in experts}
    )
    present = {(layer, expert) for layer, expert, _ in experts}
    missing = [
        finding(
            "CK240",
            "$.expert_files",
            f"expert file of MoE layer {layer}, expert {expert} (expert-parallel rank {expert // per_rank}) is missing",
            "restore it from the run that wrote the checkpoint; that expert's weights are lost without it "
            "(DeepSpeed's load_checkpoint opens it)",
            file=f"layer_{layer}_expert_{expert}_{MODEL_FILE}",
        )
        for layer, count in sorted(layers.items())
        for expert in range(count)
        if (layer, expert) not in present
    ]
    if missing:
        raise CheckpointInvalid(missing, where)


def describe(
    folder: Path, states: StateCache, hash_algorithm: str | None = None, live: LiveMasters | None = None
) -> CheckpointIndex:
    b = IndexBuilder(folder, states, hash_algorithm, live)
    optim = {int(m.group(1)): p.name for p in folder.iterdir() if (m := OPTIM_RE.match(p.name))}
    expp = {int(m.group(1)): p.name for p in folder.iterdir() if (m := EXPP_RE.match(p.name))}
    experts = list_expert_files(folder)
    n_experts = int((b.model.get("num_experts") or [0])[0]) or len({e for _, e, _ in experts})
    if live is not None:  # the live engine's layout and masters (live/masters.py)
        assert live.moe is not None  # set for a MoE engine
        (stage, world, edp, ep), masters, replicas = live.moe, live.masters, live.replicas
    elif optim:
        first = states.state(folder / optim[min(optim)]).get("optimizer_state_dict") or {}
        counts, stage = first.get("partition_count"), int(first.get("zero_stage", 0))
        if not isinstance(counts, list) or len(counts) != 2 or len(optim) % int(counts[1]):
            where = experts[0][2] if experts else optim[min(optim)]
            raise UnsupportedCheckpoint(
                f"MoE expert file {where} beside optimizer files with partition counts {counts} "
                f"({len(optim)} files): not one dense and one expert optimizer group",
                _HINT,
                where,
            )
        world, edp = len(optim), int(counts[1])
        ep = world // edp
    else:
        stage, world, edp, ep = 0, 1, 1, len(expp)
    if not ep or n_experts % ep:
        raise UnsupportedCheckpoint(f"{n_experts} experts over {ep} expert-parallel ranks", _HINT, MODEL_FILE)
    per_rank = n_experts // ep
    if live is None:  # the masters are named from the expert files: every one must be there
        _refuse_missing_experts(b.model, experts, n_experts, per_rank, str(folder))
        masters = moe_zero_masters(folder, states) if optim else stage0_masters(folder, states)
        replicas = [] if optim else stage0_replicas(folder, states)
    expert_of = {}
    expert_files = []
    for layer, expert, rel in experts:
        state = states.state(folder / rel)
        keys = list(state) if isinstance(state, dict) else []
        expert_of.update({k: expert for k in keys})
        for k in keys:  # the expert's weight in the training dtype (the module holds no experts)
            if isinstance(state[k], TensorRef):
                b.model_dtypes.setdefault(k, state[k].dtype)
        entry = ExpertFile(
            path=rel,
            moe_layer=layer,
            expert=expert,
            expert_parallel_rank=expert // per_rank,
            local_expert=expert % per_rank,
            size=(folder / rel).stat().st_size,
            tensors={k: k for k in keys},
        )
        if hash_algorithm:
            from ...checkpoint.hashing import file_digest

            entry.hash = file_digest(folder / rel, hash_algorithm)
        expert_files.append(entry)
    dense = [m for n, m in masters.items() if n not in expert_of]
    missing = sorted(set(masters) - set(expert_of) - {m.name for m in dense})
    if missing:
        raise UnsupportedCheckpoint(f"experts {missing[:3]} have no expert file", _HINT, MODEL_FILE)

    def copies_of(names):
        return [(m, c) for m, c in replicas if m.name in names]

    def ranks(of_domain):
        return {rel: of_domain(r) for r, rel in optim.items()}

    dense_replicas = copies_of({m.name for m in dense})
    domains = [
        b.domain(
            "dense",
            Coordinate(pipeline=0, tensor=0),
            "data_parallel",
            dense,
            ("optimizer_states" if stage or dense[0].segments[0][0] != MODEL_FILE else "module") if dense else "module",
            files_of(b, dense, dense_replicas, ranks(lambda r: r)),
            size=world,
            stage=stage,
            replicas=dense_replicas,
        )
    ]
    domains[0].manifest.buffers = b.buffers()  # the dense module's; an expert's are refused by name
    for e in range(ep):
        mine = [m for n, m in masters.items() if n in expert_of and expert_of[n] // per_rank == e]
        mine_replicas = copies_of({m.name for m in mine})
        files = files_of(b, mine, mine_replicas, ranks(lambda r: r // ep))
        files = [f for f in files if f.role != "model_states"]  # experts are not in the module
        if e in expp and expp[e] not in {f.path for f in files}:
            files.append(b.file(expp[e], "optimizer_states", [0]))  # the experts' optimizer state (fp32)
        in_expert_files = bool(mine) and mine[0].segments[0][0].startswith("layer_")
        domains.append(
            b.domain(
                f"expert:ep_size_{ep}:ep{e}",
                Coordinate(pipeline=0, tensor=0, expert=e),
                f"expert_data_parallel:ep_size_{ep}",
                mine,
                "expert_files" if in_expert_files else "optimizer_states",
                files,
                size=edp,
                group=1,
                stage=stage,
                replicas=mine_replicas,
                source="moe_expert",
            )
        )
    return b.index("zero", domains, expert=ep, expert_files=expert_files)

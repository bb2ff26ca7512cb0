"""The checkpoint index of a live ZeRO stage-0, native MoE or stage-0 pipeline engine (issue #17; a stage-0 pipeline
with tensor-parallel stages too: one domain per stage and tensor rank, #40).

The directory producers (``describe.index_builder``, ``describe.moe``, ``describe.pipeline_stage0``) name these
checkpoints' fp32 masters from the files, by rules (module order, DeepSpeed's expert renaming, the
expert-data-parallel grouping). The live engine knows them: each rank says which of its masters it
saves, where (file, key in the pickle, element offset in that tensor), and as which global name,
reading the optimizer it steps (``FP16_UnfusedOptimizer.fp32_groups``, ``FP16_Optimizer``'s flat
groups, a ZeRO optimizer's flat partitions, ``BF16_Optimizer``'s), the expert groups DeepSpeed built
and its checkpoint file names.

* ``local_masters(engine)``: this rank's description (no collective call, JSON-ready);
* ``live_index(described)``: the index of every rank's descriptions, without files (the layout);
* ``resolve(described, folder, states)``: the masters as saved (byte ranges read from the files'
  zip directories and pickles, checked against what the engine said), for the directory producers
  to assemble the index the save hook writes (``save/masters.py``).

Imports torch and DeepSpeed only inside ``local_masters``.
"""

from __future__ import annotations

import math
import os
import re

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import EngineLayoutMismatch, UnsupportedEngine
from ...format.dtypes import ITEMSIZE, dtype_name
from ..describe.index_builder import LiveMasters
from ..kinds import kind_of_engine
from ..layout.masters import MODEL_FILE, MasterTensor, value_at
from .model_parallel import split_rules
from .refusals import refuse_unsaveable

_LOCAL_EXPERT = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")
_FLAT = ("optimizer_state_dict", "single_partition_of_fp32_groups")


def _refuse(engine, kind: str, client_state: dict | None = None) -> dict | None:
    """Refuses what is not described; returns a tensor-parallel pipeline's split rules (``split_rules``), else None."""
    refuse_unsaveable(engine)
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    cls = type(opt).__name__
    rules = None
    if kind == "pipeline_stage0":
        if cls != "BF16_Optimizer":
            raise UnsupportedEngine(f"a ZeRO stage-0 pipeline with {cls}: only BF16_Optimizer's is described")
        if int(engine.mp_world_size) != int(engine.num_stages):  # tensor-parallel stages: the rules of their shards
            rules = split_rules(client_state)
    elif int(getattr(engine, "mp_world_size", 1) or 1) > 1 or type(engine).__name__ == "PipelineEngine":
        raise UnsupportedEngine(f"{kind} combined with tensor or pipeline parallelism is not described")
    if kind == "moe" and stage == 3:
        raise UnsupportedEngine("MoE at ZeRO stage 3 is not described (no expert optimizer groups)")
    if stage == 0 and kind != "pipeline_stage0":
        fp32 = not (engine.bfloat16_enabled() or engine.fp16_enabled())
        described = ("FP16_UnfusedOptimizer", "FP16_Optimizer") if kind == "stage0" else ("FP16_UnfusedOptimizer",)
        if not fp32 and cls not in described:
            raise UnsupportedEngine(
                f"ZeRO stage 0{' MoE' if kind == 'moe' else ''} with {cls}: only "
                + " and ".join(described)
                + "'s fp32 masters are described"
            )
    seen: dict[int, str] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            raise UnsupportedEngine(f"tied parameters ({name!r} is {seen[id(param)]!r}) at {kind}: not described")
        seen[id(param)] = name
        if not param.requires_grad:
            raise UnsupportedEngine(f"frozen parameter {name!r} in a {kind} engine: not described yet")
    return rules


def _base(path: str) -> str:
    return os.path.basename(path)


def local_masters(engine, client_state: dict | None = None) -> dict:
    """What this rank saves of the masters, and its place (JSON-ready, for the gather). ``client_state``: what the
    save hands DeepSpeed (a tensor-parallel pipeline's split rules)."""
    import torch.distributed as dist

    kind = kind_of_engine(engine).masters_kind
    if kind is None:
        raise UnsupportedEngine("not a ZeRO stage-0 or MoE engine")
    rules = _refuse(engine, kind, client_state)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {
        "kind": kind,
        "rank": dist.get_rank(),
        "data": int(dist.get_rank(group=engine.optimizer.dp_process_group))
        if hasattr(engine.optimizer, "dp_process_group")
        else dist.get_rank(),
        "stage": engine.zero_optimization_stage(),
        "dp": int(engine.dp_world_size),
        "pieces": [],
        "domains": {},
        "dtypes": {n: dtype_name(p.dtype) for n, p in engine.module.named_parameters()},
    }
    out["buffers"] = _buffers(engine, kind)
    if kind == "stage0":
        _stage0(engine, names, out)
    elif kind == "moe":
        _moe(engine, names, out)
    else:
        _pipeline(engine, names, out)
        out["rules"] = rules
    return out


def _buffers(engine, kind: str) -> list[dict]:
    """The persistent buffers DeepSpeed saves in the model states' ``module`` (its ``buffer_names``)."""
    names = engine._get_buffer_names() if hasattr(engine, "_get_buffer_names") else []
    held = dict(engine.module.named_buffers()) if names else {}
    out = []
    for name in names:
        if kind == "pipeline_stage0" or _LOCAL_EXPERT.search(name):  # saved in layer or expert files
            raise UnsupportedEngine(f"buffer {name!r} of a {kind} engine, saved outside the module: not described yet")
        out.append({"name": name, "shape": list(held[name].shape), "dtype": dtype_name(held[name].dtype)})
    return out


def gather_described(engine, dist=None, client_state: dict | None = None) -> list[dict]:
    """Every rank's ``local_masters`` (one gather). A rank's refusal is raised on every rank: none is
    left waiting in a collective while another refuses."""
    from .gather import gather

    try:
        mine, error = local_masters(engine, client_state), None
    except Exception as exc:
        mine, error = None, exc
    rank = dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else 0
    gathered = gather((mine, f"rank {rank}: {type(error).__name__}: {error}" if error else None), dist)
    if error is not None:
        raise error
    others = [e for _, e in gathered if e]
    if others:
        raise UnsupportedEngine("another rank refused the engine: " + "; ".join(others))
    return [d for d, _ in gathered]


def _piece(domain, index, name, shape, file, key, offset=0, numel=None, order=0, copy=False) -> dict:
    numel = math.prod(shape) if numel is None else numel
    return {
        "domain": domain,
        "index": index,
        "name": name,
        "shape": list(shape),
        "file": file,
        "key": list(key),
        "offset": offset,
        "numel": numel,
        "order": order,
        "copy": copy,
    }


def _stage0(engine, names, out) -> None:
    out["stored_in"] = "module"
    if not engine.save_non_zero_checkpoint:  # only data-parallel rank 0 writes the model states
        return
    out["domains"]["dense"] = 0
    model = _base(engine._get_ckpt_name("", ""))
    opt = engine.optimizer
    if type(opt).__name__ == "FP16_UnfusedOptimizer":
        out["stored_in"] = "model_states"
        index = 0
        for g, group in enumerate(opt.fp16_groups):
            for i, p in enumerate(group):
                key: tuple[str | int, ...] = ("optimizer", "fp32_groups", g, i)
                out["pieces"].append(_piece("dense", index, names[id(p)], p.shape, model, key))
                index += 1
        return
    if type(opt).__name__ == "FP16_Optimizer":
        # Its low-precision parameters are views into fp16_groups_flat[g]; fp32_groups_flat[g] holds
        # their masters at the same element offsets.
        out["stored_in"] = "model_states"
        index = 0
        for g, (group, flat) in enumerate(zip(opt.fp16_groups, opt.fp16_groups_flat, strict=True)):
            for p in group:
                offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()
                key = ("optimizer", "fp32_groups_flat", g)
                out["pieces"].append(_piece("dense", index, names[id(p)], p.shape, model, key, offset))
                index += 1
        return
    for index, (name, p) in enumerate(engine.module.named_parameters()):
        out["pieces"].append(_piece("dense", index, name, p.shape, model, ("module", name)))


def _flat_pieces(out, group, partition: int, rename, domain_of, file: str, key) -> None:
    """The pieces of a flat group's params inside this rank's partition ``partition``."""
    size = group.partition_numel
    lo, hi = partition * size, (partition + 1) * size
    for index, param in enumerate(group.params):
        start, stop = max(param.offset, lo), min(param.offset + param.numel, hi)
        if start < stop:
            name = rename(param.name)
            out["pieces"].append(
                _piece(domain_of(name), index, name, param.shape, file, key, start - lo, stop - start, partition)
            )


def _moe(engine, names, out) -> None:
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    layers = [m for _, m in engine.module.named_modules() if isinstance(m, MoE)]
    group_names = {m.expert_group_name for m in layers}
    if len(group_names) != 1:
        raise UnsupportedEngine(f"MoE layers in {len(group_names)} expert groups: one expert-parallel size only")
    if out["stage"] == 0 and len(layers) != 1:  # the expert files of stage 0 are named by MoE layer
        raise UnsupportedEngine(f"{len(layers)} MoE layers at ZeRO stage 0: one is described")
    (group_name,) = group_names
    local = layers[0].num_local_experts
    ep, e = groups._get_expert_parallel_world_size(group_name), groups._get_expert_parallel_rank(group_name)
    edp, edp_rank = (
        groups._get_expert_data_parallel_world_size(group_name),
        groups._get_expert_data_parallel_rank(group_name),
    )
    stage = out["stage"]
    out.update(expert=e, ep=ep, edp=edp, edp_rank=edp_rank, stored_in="module", world=dist.get_world_size())
    expert_id = f"expert:ep_size_{ep}:ep{e}"

    def rename(n: str) -> str:  # engine._save_moe_checkpoint: expp_rank * num_local_experts + local id
        m = _LOCAL_EXPERT.search(n)
        return n if m is None else n[: m.start(2)] + str(e * local + int(m.group(2))) + n[m.end(2) :]

    experts = {rename(n) for n, p in engine.module.named_parameters() if not getattr(p, "allreduce", True)}
    out["dtypes"] = {rename(n): d for n, d in out["dtypes"].items()}
    out["experts"] = sorted(experts)

    def domain_of(n):
        return expert_id if n in experts else "dense"

    opt = engine.optimizer
    if stage in (1, 2):
        from .groups import flat_groups_stage12

        file = _base(engine._get_zero_ckpt_name("", ""))
        out["domains"] = {"dense": out["data"], expert_id: edp_rank}
        for g, group in enumerate(flat_groups_stage12(engine, names)):
            partition = dist.get_rank(group=opt.real_dp_process_group[g])
            _flat_pieces(out, group, partition, rename, domain_of, file, (*_FLAT, g))
        return
    # Stage 0: expert-data-parallel rank 0 writes expp_rank_<e> and its experts; rank 0 the model states.
    if edp_rank != 0:
        return
    out["domains"][expert_id] = 0
    expp = _base(engine._get_optimizer_ckpt_name("", "", e))
    model = _base(engine._get_ckpt_name("", ""))
    if out["rank"] == 0:
        out["domains"]["dense"] = 0
    if type(opt).__name__ == "FP16_UnfusedOptimizer":
        for g, group in enumerate(opt.fp16_groups):
            for i, p in enumerate(group):
                name, key = rename(names[id(p)]), ("optimizer", "fp32_groups", g, i)
                dense = domain_of(name) == "dense"
                out["pieces"].append(_piece(domain_of(name), i, name, p.shape, expp, key, copy=dense and e != 0))
                if out["rank"] == 0:  # mp_rank_00 repeats expp_rank_0's optimizer state
                    out["pieces"].append(_piece(domain_of(name), i, name, p.shape, model, key, copy=True))
        return
    index = {"dense": 0, expert_id: 0}
    for n, p in engine.module.named_parameters():
        name = rename(n)
        domain = domain_of(name)
        if domain == "dense" and out["rank"] == 0:
            out["pieces"].append(_piece(domain, index[domain], name, p.shape, model, ("module", name)))
        elif domain != "dense":
            layer = 0  # one MoE layer: DeepSpeed numbers its expert files by MoE layer
            local_expert = _LOCAL_EXPERT.search(name)
            assert local_expert is not None  # an expert parameter (allreduce False): DeepSpeed names it so
            expert = int(local_expert.group(2))
            file = _base(engine._get_expert_ckpt_name("", layer, expert, "", checkpoint_mp_rank=0))
            out["pieces"].append(_piece(domain, index[domain], name, p.shape, file, (name,)))
        index[domain] += 1


def _pipeline(engine, names, out) -> None:
    import torch.distributed as dist

    from .groups import flat_groups_bf16_optimizer

    stage, tensor = engine.grid.get_pipe_parallel_rank(), engine.grid.get_slice_parallel_rank()
    pp = int(engine.num_stages)
    out.update(pipeline=stage, tensor=tensor, mp_rank=int(engine.checkpoint_mp_rank), pp=pp)
    out["tp"] = int(engine.mp_world_size) // pp
    domain = f"pp{stage}-tp{tensor}"
    out["domains"] = {domain: out["data"]}
    opt = engine.optimizer
    file = _base(engine._get_zero_ckpt_name("", ""))
    model = _base(engine._get_ckpt_name("", ""))
    index = 0
    for g, group in enumerate(flat_groups_bf16_optimizer(engine, names)):
        partition = dist.get_rank(group=opt.real_dp_process_group[g])
        before = len(out["pieces"])
        _flat_pieces(out, group, partition, lambda n: n, lambda n: domain, file, (*_FLAT, g))
        for piece in out["pieces"][before:]:
            piece["index"] += index
            if engine.save_non_zero_checkpoint:  # the model states repeat this rank's optimizer state
                copy = {**piece, "file": model, "key": ["optimizer", "single_partition_of_fp32_groups", g]}
                out["pieces"].append({**copy, "copy": True})
        index += len(group.params)
    layers, shapes = {}, {}
    module = engine.module
    for local, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "state_dict"):
            layers[module._local_start + local] = module.ckpt_layer_path("", local)
            shapes[str(module._local_start + local)] = {k: list(t.shape) for k, t in sorted(layer.state_dict().items())}
    out["layers"] = {str(k): _base(v) for k, v in layers.items()}
    out["layer_shapes"] = shapes  # a tensor-parallel pipeline's whole-model view (masters_index.live_index)


def _tensor(pieces: list[dict], folder, states: StateCache) -> MasterTensor:
    """One master (or copy) from its pieces in order, each resolved to bytes of the saved files."""
    first, segments = pieces[0], []
    dtype = None
    for piece in pieces:
        path = folder / piece["file"]
        ref = value_at(states.state(path), piece["key"]) if path.is_file() else None
        if not isinstance(ref, TensorRef):
            raise EngineLayoutMismatch(f"{piece['file']}: {'/'.join(map(str, piece['key']))} is not a saved tensor")
        flat = (list(_FLAT[:2]), ["optimizer", _FLAT[1]], ["optimizer", "fp32_groups_flat"])
        whole = piece["key"][:2] not in flat
        if (whole and list(ref.shape) != piece["shape"]) or piece["offset"] + piece["numel"] > ref.numel:
            raise EngineLayoutMismatch(
                f"{piece['file']}: {'/'.join(map(str, piece['key']))} has shape {list(ref.shape)}, not where the "
                f"live engine puts {piece['name']!r} ({piece['shape']}, elements {piece['offset']}+{piece['numel']})"
            )
        base, _ = tensor_byte_range(ref, states.members(path))
        item = ITEMSIZE[ref.dtype]
        segments.append((piece["file"], base + piece["offset"] * item, piece["numel"] * item))
        dtype = ref.dtype
    if sum(p["numel"] for p in pieces) != math.prod(first["shape"]):
        raise EngineLayoutMismatch(f"the saved pieces of {first['name']!r} do not make its shape {first['shape']}")
    assert dtype is not None  # pieces is not empty (pieces[0] above): the loop set it
    return MasterTensor(first["name"], tuple(first["shape"]), dtype, tuple(segments), tuple(first["key"]))


def _domain_order(domain: str) -> tuple:
    return (domain != "dense", domain)


def resolve(described: list[dict], folder, states: StateCache) -> LiveMasters:
    """Every rank's pieces, located in the saved files of ``folder`` (rank 0, after the save)."""
    pieces = sorted(
        (p for d in described for p in d["pieces"]),
        key=lambda p: (_domain_order(p["domain"]), p["index"], p["file"] != MODEL_FILE, p["file"], p["order"]),
    )
    # by (domain, name): a tensor-parallel pipeline's tensor ranks hold masters of the same local name
    masters: dict[tuple[str, str], list] = {}
    copies: dict[tuple[str, str], list] = {}
    for p in pieces:
        key = (p["file"], p["name"]) if p["copy"] else (p["domain"], p["name"])
        (copies if p["copy"] else masters).setdefault(key, []).append(p)
    dtypes = {}
    for d in described:
        dtypes.update(d["dtypes"])
    found = {key: _tensor(ps, folder, states) for key, ps in masters.items()}
    copy_order = sorted(copies.values(), key=lambda ps: (ps[0]["file"] != MODEL_FILE, ps[0]["file"], ps[0]["key"]))
    replicas = [(found[ps[0]["domain"], ps[0]["name"]], _tensor(ps, folder, states)) for ps in copy_order]
    first = described[0]
    named = {name: master for (_, name), master in found.items()}
    live = LiveMasters(masters=named, replicas=replicas, dtypes=dtypes, stored_in=first.get("stored_in", "module"))
    if first["kind"] == "moe":
        stage = first["stage"]
        live.moe = (stage, first["world"] if stage else 1, first["edp"] if stage else 1, first["ep"])
    if first["kind"] == "pipeline_stage0":
        live.by_mp_rank = {}
        for d in described:
            domain = f"pp{d['pipeline']}-tp{d['tensor']}"
            mine = [master for key, master in found.items() if key[0] == domain]
            theirs = [c for _, c in replicas if _domain_of_copy(c, copies) == domain]
            live.by_mp_rank[d["mp_rank"]] = (mine, theirs)
    return live


def _domain_of_copy(copy: MasterTensor, copies: dict) -> str:
    return copies[(copy.segments[0][0], copy.name)][0]["domain"]

"""The checkpoint index of a live ZeRO stage-0, native MoE or stage-0 pipeline engine (issue #17).

``live_index``: the layout every rank's ``masters.local_masters`` describes, without files (what
``index_from_engine`` returns for these engines). ``with_engine_view`` adds what only the engine knows
(``topology.ranks``, each domain's ``members``, ``degrees_source: engine``) to an index of the saved files.
"""

from __future__ import annotations

from ..._version import __version__
from ...errors import EngineLayoutMismatch
from ...format.index_models import (
    INDEX_FORMAT,
    INDEX_VERSION,
    CheckpointIndex,
    Coordinate,
    Degrees,
    RankCoordinate,
    Topology,
)
from ...format.models import Buffer, Producer
from ...format.partition import ParamSpec
from ..describe.index_builder import masters_domain


def domains_of(described: list[dict]) -> list[tuple]:
    """(id, coordinate, process group, size, optimizer group, source) of every domain, in the index's order."""
    first = described[0]
    kind, stage = first["kind"], first["stage"]
    if kind == "stage0":
        return [("dense", Coordinate(pipeline=0, tensor=0), "data_parallel", 1, 0, "none")]
    if kind == "pipeline_stage0":  # in mp rank order: stage x tensor degree + tensor rank
        return [
            (f"pp{p}-tp{t}", Coordinate(pipeline=p, tensor=t), "data_parallel", first["dp"], 0, "pipeline_layer")
            for p in range(first["pp"])
            for t in range(first.get("tp", 1))
        ]
    ep = first["ep"]
    out = [("dense", Coordinate(pipeline=0, tensor=0), "data_parallel", first["world"] if stage else 1, 0, "none")]
    for e in range(ep):
        coordinate = Coordinate(pipeline=0, tensor=0, expert=e)
        size = first["edp"] if stage else 1
        out.append(
            (f"expert:ep_size_{ep}:ep{e}", coordinate, f"expert_data_parallel:ep_size_{ep}", size, 1, "moe_expert")
        )
    return out


def members_of(described: list[dict], domain: str, size: int) -> list[int]:
    """The global rank of each domain rank: the ranks that hold (stage 0: save) the domain's masters."""
    by_rank = {d["domains"][domain]: d["rank"] for d in described if domain in d["domains"]}
    if sorted(by_rank) != list(range(size)):
        raise EngineLayoutMismatch(f"domain {domain}: ranks {sorted(by_rank)} of {size} hold its masters")
    return [by_rank[r] for r in range(size)]


def topology_of(described: list[dict]) -> Topology:
    first = described[0]
    pp, tp = first.get("pp", 1), first.get("tp", 1)
    degrees = Degrees(pipeline=pp, tensor=tp, data=first["dp"])
    if first["kind"] == "moe":
        degrees.expert = first["ep"]
    ranks = []
    for d in sorted(described, key=lambda d: d["rank"]):
        coord = RankCoordinate(
            rank=d["rank"],
            pipeline=d.get("pipeline", 0),
            tensor=d.get("tensor", 0),
            data=d["data"],
            mp_rank=d.get("mp_rank", 0),
        )
        if first["kind"] == "moe":
            coord.expert = d["expert"]
        ranks.append(coord)
    return Topology(degrees=degrees, degrees_source="engine", model_parallel_size=pp * tp, ranks=ranks)


def with_engine_view(index: CheckpointIndex, described: list[dict]) -> CheckpointIndex:
    """What only the live engine knows, on an index of the saved files: the rank grid and members."""
    topology = topology_of(described)
    if topology.degrees != index.topology.degrees:
        raise EngineLayoutMismatch(
            f"the engine's degrees {topology.degrees} are not the files' {index.topology.degrees}"
        )
    index.topology = topology
    for domain in index.domains:
        domain.members = members_of(described, domain.id, domain.size)
    return index


def live_index(described: list[dict]) -> CheckpointIndex:
    """The index of the live engine without files: domains (no masters), parameters, topology."""
    import deepspeed

    producer = Producer(
        tool="ckptspec", tool_version=__version__, framework="deepspeed", framework_version=deepspeed.__version__
    )
    first = described[0]
    dtypes = {n: t for d in described for n, t in d["dtypes"].items()}
    pieces = sorted((p for d in described for p in d["pieces"] if not p["copy"]), key=lambda p: p["index"])
    domains, parameters = [], []
    for id, coordinate, group_name, size, group, source in domains_of(described):
        specs: dict[str, ParamSpec] = {}
        for p in pieces:
            if p["domain"] == id and p["name"] not in specs:
                specs[p["name"]] = ParamSpec(p["name"], tuple(p["shape"]), dtypes[p["name"]])
        domain, params = masters_domain(
            producer,
            id,
            coordinate,
            group_name,
            list(specs.values()),
            [],
            size=size,
            group=group,
            stage=first["stage"] if first["kind"] == "moe" else 0,
            source=source,
        )
        domain.members = members_of(described, id, size)
        if id == "dense":  # the module's persistent buffers, saved beside its weights
            domain.manifest.buffers = [Buffer(**b) for b in first["buffers"]]
        if first["kind"] == "pipeline_stage0":
            domain.manifest.layout.pipeline_parallel_size = first["pp"]
            domain.manifest.layout.tensor_parallel_size = first.get("tp", 1)
            layers = {k: v for d in described for k, v in d["layers"].items()}
            for param in params:
                layer, key = param.name.split(".", 1)
                param.shards[0].layer_file, param.shards[0].layer_key = layers[layer], key
        domains.append(domain)
        parameters += params
    if first["kind"] == "pipeline_stage0" and first.get("tp", 1) > 1:
        parameters = _tensor_pipeline_parameters(described, domains)
    index = CheckpointIndex(
        format=INDEX_FORMAT,
        format_version=INDEX_VERSION,
        producer=producer,
        kind="zero",
        topology=topology_of(described),
        domains=domains,
        layer_files=[],
        parameters=parameters,
    )
    if first["kind"] == "moe":
        index.expert_files = []
    return index


def _tensor_pipeline_parameters(described: list[dict], domains: list) -> list:
    """A tensor-parallel stage-0 pipeline's whole-model parameters: each tensor rank's stages and layer files a
    pipeline of their own, its shards placed by the split rules of the client state (the directory producer's code)."""
    from ..describe.tp_pipeline import tensor_ranks_view

    where = "the live engine"
    loaded: dict[int, dict] = {}
    rules = {}
    for d in described:
        rules[f"pp{d['pipeline']}-tp{d['tensor']}"] = d["rules"]
        for layer, name in d["layers"].items():
            loaded.setdefault(d["tensor"], {})[int(layer)] = (name, d["layer_shapes"][layer])
    _, parameters = tensor_ranks_view(
        domains, loaded, described[0]["tp"], where, lambda _, p: (None, rules[p.shards[0].domain], where)
    )
    return parameters

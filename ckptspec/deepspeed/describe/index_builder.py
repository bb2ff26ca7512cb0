"""What the checkpoint index of a ZeRO stage-0, native MoE or universal checkpoint (issue #17) is built with.

These checkpoints keep their fp32 masters where format 1.x has no locator for them (``masters.py``,
``moe_masters.py`` find them). Each is described as a checkpoint index whose domains carry
``masters``: one tensor locator per master (or per piece of a master a ZeRO partition cut), and the
copies DeepSpeed saved of them (``replicas``). A domain's embedded manifest (format 1.1) names its
parameters (one flat group of ``partition_count`` 1, ``zero_stage`` 0: it locates nothing; with a hash
algorithm each parameter gets the digests of its master and moments, ``masters_digests.py``) and its
files; the stage the run was configured with is ``configured_zero_stage``. Domains:

* stage 0 (``s0-*``): one ``dense`` domain;
* MoE: ``dense`` (``data_parallel``) and one ``expert:ep_size_<ep>:ep<e>`` domain per
  expert-parallel rank (``expert_data_parallel:ep_size_<ep>``), each expert file in ``expert_files``;
* universal folders: ``kind: "universal"``, one ``universal`` domain over ``zero/<name>/fp32.pt``.

``IndexBuilder`` and ``masters_domain`` are shared by those producers (``stage0.py``, ``moe.py``,
``pipeline_stage0.py``, ``universal.py``) and the live engine's (``live/masters_index.py``).

The persistent buffers (``buffer_names``) are in the domain manifest's ``buffers``, read from the
``module`` of the model states it lists (stage 0, MoE's dense domain, universal folders: the copy of
the source's); a universal folder's ties (``shared_params``) are in its ``aliases`` (the owner's master
is the tie's). Metadata only: no tensor bytes, no pickle code.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..._version import __version__
from ...checkpoint.hashing import file_digest
from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import UnsupportedCheckpoint
from ...format.dtypes import ITEMSIZE, Dtype
from ...format.index_models import (
    INDEX_FORMAT,
    INDEX_VERSION,
    CheckpointIndex,
    Coordinate,
    Degrees,
    Domain,
    IndexParameter,
    MasterLocator,
    Masters,
    Shard,
    Topology,
)
from ...format.models import Buffer, Layout, Manifest, Producer, ShardFile
from ...format.partition import ParamSpec, flat_group
from ...format.version import FORMAT_VERSION
from ..layout.masters import EXPERT_FILE_RE, EXPP_RE, MODEL_FILE, MasterTensor
from ..layout.names import MODEL_RE, OPTIM_RE

# The values of Masters.stored_in, IndexParameter.placement_source and CheckpointIndex.kind (index_models.py).
StoredIn = Literal["module", "model_states", "optimizer_states", "expert_files", "universal"]
PlacementSource = Literal["affine_map", "universal_checkpoint_info", "pipeline_layer", "none", "engine", "moe_expert"]
FileRole = Literal["model_states", "optimizer_states", "other"]

_EXPERT_ID = re.compile(r"\.deepspeed_experts\.(\d+)\.")


def _locators(folder: Path, master: MasterTensor, states: StateCache) -> list[MasterLocator]:
    key = list(master.key)
    if key[:1] == ["flat"]:
        key = ["optimizer_state_dict", "single_partition_of_fp32_groups", master.key[1]]
    out = []
    item = ITEMSIZE[master.dtype]
    for rel, offset, nbytes in master.segments:
        members = states.members(folder / rel)
        member, (base, size) = next((m, r) for m, r in members.items() if r[0] <= offset < r[0] + max(r[1], 1))
        out.append(
            MasterLocator(
                param=master.name,
                file=rel,
                key=key,
                member=member,
                data_offset=base,
                member_size=size,
                dtype=master.dtype,
                element_offset=(offset - base) // item,
                numel=nbytes // item,
            )
        )
    return out


def masters_domain(
    producer: Producer,
    id: str,
    coordinate: Coordinate,
    process_group: str,
    specs: list[ParamSpec],
    files: list[ShardFile],
    *,
    size: int = 1,
    group: int = 0,
    stage: int = 0,
    source: PlacementSource = "none",
) -> tuple[Domain, list[IndexParameter]]:
    """A domain whose masters are located apart (no ``masters`` yet) and its whole-model parameters:
    its 1.x manifest names the parameters (one flat group of ``partition_count`` 1, ``zero_stage`` 0)
    and lists ``files``. Shared by the directory producers and the live engine's (live/masters.py)."""
    manifest = Manifest(
        format="ckptspec.manifest",
        format_version=FORMAT_VERSION,  # the newest: generate --hash gives its parameters 1.1's digests
        producer=producer,
        layout=Layout(
            zero_stage=0,
            world_size=size,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            model_dtype=specs[0].dtype if specs else "float32",
            master_dtype="float32",
            round_robin=False,
            parameter_alignment=False,
            tail_padding_saved=False,
        ),
        groups=[flat_group(specs, optimizer_group=group, partition_count=1, zero_stage=0)] if specs else [],
        frozen=[],
        buffers=[],
        aliases=[],
        excluded=[],
        files=sorted(files, key=lambda f: ({"model_states": 0, "optimizer_states": 1}.get(f.role, 2), f.path)),
    )
    domain = Domain(
        id=id,
        coordinate=coordinate,
        process_group=process_group,
        size=size,
        file_ranks={f.path: f.ranks[0] for f in manifest.files if f.role != "other"},
        optimizer_groups=[group],
        manifest=manifest,
        configured_zero_stage=stage,
    )
    parameters = [
        IndexParameter(
            name=s.name,
            shape=list(s.shape),
            dtype=s.dtype,
            role="trainable",
            shards=[Shard(domain=id, local_name=s.name, local_shape=list(s.shape), placement="whole")],
            placement_source=source,
        )
        for s in specs
    ]
    return domain, parameters


@dataclass
class LiveMasters:
    """What the live engine says about the masters (live/masters.py), resolved to the saved files:
    every master by global name (pieces in order), the copies DeepSpeed saved of them, the parameters'
    dtypes; for MoE the optimizer layout (stage, world size, expert-data-parallel size, expert degree);
    for the stage-0 pipeline the masters and copies of each model-parallel rank."""

    masters: dict[str, MasterTensor]
    replicas: list[tuple[MasterTensor, MasterTensor]]
    dtypes: dict[str, Dtype]
    stored_in: StoredIn = "module"
    moe: tuple[int, int, int, int] | None = None
    by_mp_rank: dict[int, tuple[list[MasterTensor], list[MasterTensor]]] | None = None


class IndexBuilder:
    """What every #17 index shares: the folder, the model states, the producer."""

    def __init__(self, folder: Path, states: StateCache, hash_algorithm: str | None, live: LiveMasters | None = None):
        self.folder, self.states, self.hash_algorithm = folder, states, hash_algorithm
        model: Any = None
        self.model_file: str | None = MODEL_FILE  # None where the folder holds no model-states file
        if (folder / MODEL_FILE).is_file():
            model = states.state(folder / MODEL_FILE)
        else:
            first = sorted(p for p in folder.iterdir() if MODEL_RE.match(p.name))
            model, self.model_file = (states.state(first[0]), first[0].name) if first else (None, None)
        if not isinstance(model, dict):
            raise UnsupportedCheckpoint("model states are not a dict", "is this a DeepSpeed checkpoint?", str(folder))
        self.model = model
        module: Any = model.get("module") if isinstance(model.get("module"), dict) else {}
        self.model_dtypes = {n: r.dtype for n, r in module.items() if isinstance(r, TensorRef)}
        self.producer = Producer(
            tool="ckptspec",
            tool_version=__version__,
            framework="deepspeed",
            framework_version=str(model.get("ds_version", "unknown")),
        )
        self.parameters: list[IndexParameter] = []
        if live is not None:  # the live engine's parameter dtypes, not the files'
            self.model_dtypes.update(live.dtypes)

    def buffers(self) -> list[Buffer]:
        """The persistent buffers the model states name (``buffer_names``), as saved in their ``module``."""
        module = self.model.get("module")
        out = []
        for name in self.model.get("buffer_names") or []:
            ref = module.get(name) if isinstance(module, dict) else None
            if not isinstance(ref, TensorRef):
                raise UnsupportedCheckpoint(
                    f"buffer {name!r} is not in the module of the model states",
                    "buffers held elsewhere (an expert's, a pipeline layer's) are not described yet",
                    self.model_file,
                )
            out.append(Buffer(name=name, shape=list(ref.shape), dtype=ref.dtype))
        return out

    def file(self, rel: str, role: FileRole, ranks: list[int]) -> ShardFile:
        path = self.folder / rel
        entry = ShardFile(path=rel, role=role, ranks=ranks, size=path.stat().st_size, partitions=[])
        if self.hash_algorithm:
            entry.hash = file_digest(path, self.hash_algorithm)
        return entry

    def domain(
        self,
        id: str,
        coordinate: Coordinate,
        process_group: str,
        masters: list[MasterTensor],
        stored_in: StoredIn,
        files: list[ShardFile],
        *,
        size: int = 1,
        group: int = 0,
        stage: int = 0,
        replicas: Sequence[tuple[MasterTensor, MasterTensor]] = (),
        source: PlacementSource = "none",
        add_parameters: bool = True,
    ) -> Domain:
        specs = [ParamSpec(m.name, m.shape, self.model_dtypes.get(m.name, m.dtype)) for m in masters]
        domain, parameters = masters_domain(
            self.producer,
            id,
            coordinate,
            process_group,
            specs,
            files,
            size=size,
            group=group,
            stage=stage,
            source=source,
        )
        domain.masters = Masters(
            stored_in=stored_in, tensors=[loc for m in masters for loc in _locators(self.folder, m, self.states)]
        )
        if replicas:
            domain.replicas = [loc for _, copy in replicas for loc in _locators(self.folder, copy, self.states)]
        if self.hash_algorithm:  # format 1.1's per-tensor digests: each master's and its moments'
            from .masters_digests import add_masters_digests

            add_masters_digests(self.folder, self.states, domain)
        if add_parameters:
            self.parameters += parameters
        return domain

    def index(
        self, kind: Literal["zero", "universal"], domains: list[Domain], *, expert: int | None = None, **extra
    ) -> CheckpointIndex:
        degrees = Degrees(pipeline=1, tensor=1, data=int(self.model.get("dp_world_size") or 1))
        if expert is not None:
            degrees.expert = expert
        return CheckpointIndex(
            format=INDEX_FORMAT,
            format_version=INDEX_VERSION,
            producer=self.producer,
            kind=kind,
            topology=Topology(degrees=degrees, degrees_source="derived", model_parallel_size=1),
            domains=domains,
            layer_files=[],
            parameters=self.parameters,
            **extra,
        )


def files_of(
    b: IndexBuilder, masters, replicas, ranks: dict[str, int] | None = None, model: str = MODEL_FILE
) -> list[ShardFile]:
    """The model states (``model``: another tensor rank's) and every optimizer file the masters (and their copies)
    are read from."""
    rels = {model} if (b.folder / model).is_file() else set()
    rels |= {seg[0] for m in masters for seg in m.segments}
    rels |= {seg[0] for _, c in replicas for seg in c.segments}
    out = []
    for rel in sorted(rels):
        if EXPERT_FILE_RE.match(rel):
            continue  # listed in expert_files
        if MODEL_RE.match(rel):
            out.append(b.file(rel, "model_states", [0]))
        elif OPTIM_RE.match(rel) or EXPP_RE.match(rel):
            out.append(b.file(rel, "optimizer_states", [(ranks or {}).get(rel, 0)]))
        else:
            out.append(b.file(rel, "other", []))
    return out

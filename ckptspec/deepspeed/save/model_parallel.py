"""The save hook of a tensor/pipeline-parallel engine: ``engine.save_checkpoint`` plus its checkpoint index.

``ckptspec.deepspeed.save_checkpoint`` comes here when the engine needs an index
(``kinds.kind_of_engine``). As for a data-parallel engine (``zero.py``): the
layout is described from the live engine and refused before anything is written; DeepSpeed writes
into a temporary tag directory; each rank describes the files it wrote (its ZeRO files, and the
pipeline layer files of its stage when it wrote them); one gather; rank 0 validates the complete
index and writes it as the sidecar, then the tag directory takes its name, then ``latest``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ...checkpoint.hashing import file_digest
from ...checkpoint.states import StateCache
from ...format.index_models import CheckpointIndex, LayerFile
from ...format.index_validate import validate_index
from ...format.models import Manifest, ShardFile
from ..describe.digests import add_digests
from ..describe.zero import describe_files
from ..layout.names import file_order
from ..layout.tag_dir import ShardSet
from ..live.gather import gather
from ..live.model_parallel import assemble, local_description
from .protocol import describe_own_files, publish_and_broadcast, save_request, save_staged

if TYPE_CHECKING:
    from ...format.codec import Encoding


def _own_files(engine, staged: Path, mine: dict, hash_algorithm: str | None) -> list[dict]:
    """This rank's ZeRO files of its coordinate, described against its domain's layout."""
    own = ShardSet(staged)
    model = Path(engine._get_ckpt_name(str(staged.parent), staged.name))
    if engine.save_non_zero_checkpoint and model.is_file():
        own.model_files[mine["data"]] = model
    optim = Path(engine._get_zero_ckpt_name(str(staged.parent), staged.name))
    if engine.save_zero_checkpoint and optim.is_file():
        own.optim_files[mine["data"]] = optim
    layout = Manifest.model_validate(mine["manifest"])
    described = describe_files(own, layout.layout.zero_stage, hash_algorithm, StateCache(), layout)
    return [f.model_dump(mode="json", exclude_unset=True) for f in described]


def _own_layer_files(engine, staged: Path, mine: dict, hash_algorithm: str | None) -> list[dict]:
    """The pipeline layer files this rank wrote (DeepSpeed's ``PipelineModule.save_state_dict`` split):
    their sizes and hashes (``assemble`` names their tensors)."""
    if not mine["layers"]:
        return []
    from deepspeed.runtime import utils as ds_utils

    module = engine.module
    count, (dp_rank, dp_size) = len(module.forward_funcs), (mine["data"], mine["degrees"][2])
    if module.checkpoint_parallel_write_pipeline:
        offsets = ds_utils.partition_uniform(count, dp_size)
        start, stop = offsets[dp_rank], offsets[dp_rank + 1]
    else:
        start, stop = (0, count) if dp_rank == 0 else (0, 0)
    out = []
    for layer, (name, _) in sorted((int(k), v) for k, v in mine["layers"].items()):
        path = staged / name
        if not start <= layer - module._local_start < stop or not path.is_file():
            continue
        entry = LayerFile(
            path=name, layer=layer, pipeline=mine["pipeline"], tensor=None, size=path.stat().st_size, tensors={}
        )
        if hash_algorithm:
            entry.hash = file_digest(path, hash_algorithm)
        out.append(entry.model_dump(mode="json", exclude_unset=True))
    return out


def _add_digests(index: CheckpointIndex, staged: Path) -> None:
    """Every located tensor's digest, as the directory producer records them; rank 0 reads the files
    of every domain, so without a shared filesystem (it cannot see them all) there are none."""
    if not all((staged / f.path).is_file() for d in index.domains for f in d.manifest.files):
        warnings.warn("ckptspec: rank 0 cannot see every saved file; no tensor digests", stacklevel=3)
        return
    for domain in index.domains:
        add_digests(domain.manifest, staged)


def save_index_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state=None,
    hash=True,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    sidecar_encoding: Encoding = "json",
) -> CheckpointIndex:
    """``save_checkpoint`` of a tensor/pipeline-parallel engine; returns the complete index (every rank)."""
    import torch.distributed as dist

    mine = local_description(engine, exclude_frozen_parameters, client_state)  # refusals first, on every rank alike
    described = gather(mine, dist)
    assemble(described)  # the whole-model view's refusals too, before anything is written
    state, tag = save_request(engine, client_state, tag)
    distributed = dist.is_available() and dist.is_initialized()
    staged = save_staged(engine, dist, save_dir, tag, state, exclude_frozen_parameters)
    algorithm = "sha256" if hash else None
    gathered = describe_own_files(
        dist,
        staged,
        lambda: (_own_files(engine, staged, mine, algorithm), _own_layer_files(engine, staged, mine, algorithm)),
    )
    files_by_rank = {d["rank"]: files for d, (files, _) in zip(described, gathered)}

    def files_of(first: dict) -> list[ShardFile]:
        ranks = [d["rank"] for d in described if (d["pipeline"], d["tensor"]) == (first["pipeline"], first["tensor"])]
        files = [ShardFile.model_validate(f) for r in ranks for f in files_by_rank[r]]
        return sorted(files, key=lambda f: file_order(f.role, f.ranks, f.path))

    written = {lf["path"]: LayerFile.model_validate(lf) for _, layers in gathered for lf in layers}

    def layer_files_of(entries: list[LayerFile]) -> list[LayerFile]:
        """The layer files as the directory producer names their tensors, with the size and hash of the rank
        that wrote each (every one was written: DeepSpeed writes every layer of every stage)."""
        for entry in entries:
            if entry.path not in written:
                raise RuntimeError(f"ckptspec: no rank wrote the pipeline layer file {entry.path}")
            entry.size = written[entry.path].size
            if "hash" in written[entry.path].model_fields_set:
                entry.hash = written[entry.path].hash
        return entries

    index = assemble(described, files_of, layer_files_of)

    def describe():
        if hash:
            _add_digests(index, staged)
        if all((staged / f.path).is_file() for d in index.domains for f in d.manifest.files):
            # frozen parameters, buffers and ties placed as `generate` places them (index 1.1 when there are any)
            from ...checkpoint.states import StateCache
            from ..describe.index_extras import with_extras

            with_extras(index, staged, StateCache())
        return index.to_dict(), validate_index(index)

    # rank 0's index (with the digests only it computed), on every rank
    shared = (lambda: index.to_dict()) if distributed else (lambda: None)
    args = (describe, sidecar_encoding, save_latest)
    complete = publish_and_broadcast(dist, staged, save_dir, tag, *args, what="checkpoint index", shared=shared)
    if complete is not None:
        index = CheckpointIndex.model_validate(complete)
    return index

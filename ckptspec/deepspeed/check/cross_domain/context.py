"""CK23x: the files of a model-parallel checkpoint against its index, across domains.

Each domain's own files are checked by the 1.x checks (``check/domain/``); these are what only the whole
set can tell: layer files present and intact, files no domain accounts for, the degrees every
model-states file records, counters that say all coordinates come from one save, and the shapes of
the tensors each rank's files hold against the index's shards. Metadata only (file sizes, hashes
when recorded, ``data.pkl`` records through the ``StateCache``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ....checkpoint.hashing import file_digest
from ....checkpoint.output_names import is_output_name
from ....checkpoint.states import StateCache
from ....checkpoint.torchfile import TensorRef, tensor_byte_range
from ....errors import CkptspecError
from ....findings import Finding, RuleSet, finding, json_path
from ....format.index_models import CheckpointIndex
from ....format.paths import join_inside
from ....location import RemotePath, read_range
from ...layout.names import mp_rank_of
from ..domain.context import disk_files
from ..domain.files import outputs_in_tag_dir


@dataclass
class IndexContext:
    index: CheckpointIndex
    tag_dir: Path | RemotePath
    states: StateCache
    verify_hashes: bool

    def model_states(self) -> Iterator[tuple[int, str, dict]]:
        """(domain index, path, decoded state) of every readable model-states file of every domain."""
        for i, domain in enumerate(self.index.domains):
            for f in domain.manifest.files:
                path = join_inside(self.tag_dir, f.path)
                if f.role != "model_states" or path is None or not path.is_file():
                    continue
                loaded = self.states.load(path)
                if loaded.error is None and isinstance(loaded.state, dict):
                    yield i, f.path, loaded.state


IndexCheck = Callable[[IndexContext], Iterator[Finding]]
INDEX_CHECKS: RuleSet[IndexCheck] = RuleSet()
check = INDEX_CHECKS.register


@check("CK207")
def unaccounted(ctx: IndexContext) -> Iterator[Finding]:
    """A file of the tag directory no domain and no layer-file entry accounts for."""
    domains_mp = {mp_rank_of(f.path) for d in ctx.index.domains for f in d.manifest.files} - {None}
    listed = {f.path for d in ctx.index.domains for f in d.manifest.files} | {lf.path for lf in ctx.index.layer_files}
    listed |= {ef.path for ef in ctx.index.expert_files or []}  # MoE (#17)
    for rel in disk_files(ctx.tag_dir):
        if rel in listed or mp_rank_of(rel) in domains_mp or is_output_name(rel):
            continue  # a domain's stray files are its own CK207; a reconstruction's output is CK226
        yield finding(
            "CK207",
            "$",
            "file is not part of this checkpoint's index"
            + (f" (model-parallel rank {mp_rank_of(rel)} has no domain)" if mp_rank_of(rel) is not None else ""),
            "remove it, or regenerate the index if it belongs to the checkpoint",
            file=rel,
        )


@check("CK226")
def output_in_tag_dir(ctx: IndexContext) -> Iterator[Finding]:
    yield from outputs_in_tag_dir(disk_files(ctx.tag_dir))


@check("CK230")
def layer_files(ctx: IndexContext) -> Iterator[Finding]:
    """Every pipeline layer file is present, of its recorded size and hash, and holds the tensors the index
    names with the shapes of their shards."""
    shapes = {
        (s.layer_file, s.layer_key): s.local_shape for p in ctx.index.parameters for s in p.shards if s.layer_file
    }
    for i, lf in enumerate(ctx.index.layer_files):
        path = join_inside(ctx.tag_dir, lf.path)
        at = json_path("layer_files", i)
        if path is None or not path.is_file():
            yield finding(
                "CK230",
                at,
                f"pipeline layer file of layer {lf.layer} (stage {lf.pipeline}) is missing",
                "restore it from the run that wrote the checkpoint; "
                + (
                    "its stage's weights are lost without it"
                    if lf.tensors
                    else "it holds no tensor, but DeepSpeed's load_checkpoint opens it"
                ),
                file=lf.path,
            )
            continue
        # Its metadata before its hash: a remote file's hash then takes those bytes from memory (fetched once).
        loaded = ctx.states.load(path) if path.stat().st_size == lf.size else None
        if loaded is None or (
            ctx.verify_hashes and lf.hash is not None and file_digest(path, lf.hash.algorithm).digest != lf.hash.digest
        ):
            yield finding(
                "CK230",
                at,
                "pipeline layer file changed since the index was written (size or hash)",
                "restore the file of this save (a layer file of another layer or save?)",
                file=lf.path,
            )
            continue
        state = loaded.state if loaded.error is None else None
        if not isinstance(state, dict):
            yield finding(
                "CK230", at, "pipeline layer file cannot be read as a dict of tensors", "restore it", file=lf.path
            )
            continue
        if set(state) != set(lf.tensors):
            yield finding(
                "CK230",
                json_path("layer_files", i, "tensors"),
                f"holds {sorted(state)}; the index says {sorted(lf.tensors)}",
                "a layer file from another layer or model: restore the file of this save",
                file=lf.path,
            )
            continue
        for key, ref in state.items():
            want = shapes.get((lf.path, key))
            if not isinstance(ref, TensorRef) or (want is not None and list(ref.shape) != want):
                yield finding(
                    "CK230",
                    json_path("layer_files", i, "tensors", key),
                    f"{key!r} has shape {list(getattr(ref, 'shape', []))}; its shard is {want}",
                    "a layer file from another layer or model: restore the file of this save",
                    file=lf.path,
                )


@check("CK231")
def degrees(ctx: IndexContext) -> Iterator[Finding]:
    """Every model-states file records the index's degrees (when it records them at all)."""
    topo = ctx.index.topology
    want = {"pp_degree": topo.degrees.pipeline, "tp_degree": topo.degrees.tensor}
    for i, rel, state in ctx.model_states():
        dims = state.get("checkpoint_parallel_dimensions")
        got = {}
        if isinstance(dims, dict):
            got.update({k: dims.get(k) for k in want})
        if "mp_world_size" in state:
            got["mp_world_size"] = state["mp_world_size"]
        if "dp_world_size" in state:
            got["dp_world_size"] = state["dp_world_size"]
        expected = {**want, "mp_world_size": topo.model_parallel_size, "dp_world_size": topo.degrees.data}
        wrong = {k: v for k, v in got.items() if v != expected[k]}
        if wrong:
            yield finding(
                "CK231",
                json_path("domains", i),
                f"records {wrong}; the index has { ({k: expected[k] for k in wrong}) }",
                "files of runs with other parallel degrees are mixed here: restore the files of one save",
                file=rel,
                rank=0,
            )


@check("CK232")
def one_save(ctx: IndexContext) -> Iterator[Finding]:
    """Every model-parallel rank's model states come from the same save (step, samples, DeepSpeed)."""
    keys = ("global_steps", "global_samples", "ds_version")
    first: tuple | None = None
    first_file = None
    for i, rel, state in ctx.model_states():
        counters = tuple(state.get(k) for k in keys)
        if first is None:
            first, first_file = counters, rel
        elif counters != first:
            yield finding(
                "CK232",
                json_path("domains", i),
                f"saved at {dict(zip(keys, counters, strict=True))}; "
                f"{first_file} at {dict(zip(keys, first, strict=True))}",
                "a model-parallel rank's files from another save: restore the files of one save",
                file=rel,
                rank=0,
            )


@check("CK233")
def module_shards(ctx: IndexContext) -> Iterator[Finding]:
    """Each rank's saved module holds every shard with the index's local shape (a slice of another
    parameter, a transposed or resized slice)."""
    shards: dict = {}
    for p in ctx.index.parameters:
        for s in p.shards:
            shards.setdefault(s.domain, {})[s.local_name] = (p.name, s.local_shape)
    for i, rel, state in ctx.model_states():
        module = state.get("module")
        if not isinstance(module, dict):
            continue  # a pipeline stage (layer files: CK230) or ZeRO-3 placeholders
        for local, (name, shape) in shards.get(ctx.index.domains[i].id, {}).items():
            ref = module.get(local)
            if isinstance(ref, TensorRef) and ref.numel == 0:
                continue  # ZeRO-3 keeps empty placeholders
            if not isinstance(ref, TensorRef) or list(ref.shape) != shape:
                yield finding(
                    "CK233",
                    json_path("domains", i),
                    f"{local!r} (shard of {name}) is "
                    + (f"{list(ref.shape)}" if isinstance(ref, TensorRef) else "absent")
                    + f" in the module; the index says {shape}",
                    "a model-states file of another model or tensor rank: restore the files of one save",
                    file=rel,
                    rank=0,
                )


@check("CK234")
def replicas_agree(ctx: IndexContext) -> Iterator[Finding]:
    """A replicated parameter's copies in the ranks' saved modules are the same bytes (one read each;
    the masters themselves are compared again when a reconstruction reads them)."""
    modules = {}
    for i, rel, state in ctx.model_states():
        module = state.get("module")
        if isinstance(module, dict) and ctx.index.domains[i].id not in modules:
            modules[ctx.index.domains[i].id] = (i, rel, module)
    for param in ctx.index.parameters:
        if not all(s.placement == "replicated" for s in param.shards):
            continue
        copies = []
        for shard in sorted(param.shards, key=lambda s: not s.primary):
            if shard.domain not in modules:
                continue
            i, rel, module = modules[shard.domain]
            ref = module.get(shard.local_name)
            if not isinstance(ref, TensorRef) or ref.numel == 0 or not ref.is_contiguous():
                continue  # ZeRO-3 placeholders; shapes are CK233's
            path = ctx.tag_dir / rel
            try:
                offset, nbytes = tensor_byte_range(ref, ctx.states.members(path))
                copies.append((i, rel, read_range(path, offset, nbytes)))
            except (CkptspecError, OSError, ValueError):
                continue  # an unreadable file is the domain checks' finding
        for i, rel, data in copies[1:]:
            if data != copies[0][2]:
                yield finding(
                    "CK234",
                    json_path("domains", i),
                    f"replicated parameter {param.name} differs from its copy in {copies[0][1]}",
                    "tensor-parallel replicas hold the same values; a file of another save or a corrupted one",
                    file=rel,
                    rank=0,
                )

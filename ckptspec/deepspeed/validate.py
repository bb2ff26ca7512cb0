"""Shard validation: check a checkpoint's files against its manifest before any reconstruction.

One check = one function = one stable code, as in ``ckptspec.rules``; each check yields
every finding it sees, with ``file`` (relative to the tag directory) and ``rank`` set and
a JSON path into the manifest when one applies. ``docs/validation.md`` documents every check.

Only metadata is read: each ``.pt`` file's ``data.pkl`` through the restricted unpickler of
``ckptspec.torchfile`` (never ``torch.load``, so no pickled code runs) and the zip directory.
Tensor bytes are read only to verify recorded hashes. A file that cannot be read becomes a
finding naming it; the other files are still checked.

When the manifest is generated from the same files (``validate DIR`` without a sidecar),
its arithmetic comes from DeepSpeed's ``param_shapes``; the checks compare it with what the
shard files really hold (partition numels, module tensor shapes and flat-buffer offsets,
``param_slice_mappings``, per-file headers), so a corrupt ``param_shapes`` is still caught.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..checkpoint import torchfile
from ..checkpoint.states import Loaded, StateCache, code_and_hint
from .describe import MODEL_RE, OPTIM_RE, ShardSet, _real_ties, manifest_from_states, resolve_tag_dir, scan_tag_dir
from ..errors import CkptspecError
from ..findings import Finding, RuleSet, finding, has_errors, json_path
from ..checkpoint.hashing import file_digest
from ..format.models import Manifest, ShardFile
from ..format.partition import natural_order
from ..format.validate import validate_file, validate_manifest

SIDECARS = ("ckptspec.json", "ckptspec.msgpack")


# --------------------------------------------------------------------------- registry


CHECKS: RuleSet[Callable[["_Context"], Iterator[Finding]]] = RuleSet()
check = CHECKS.register


# --------------------------------------------------------------------------- context


@dataclass
class _File:
    index: int  # position in manifest.files
    entry: ShardFile
    path: Path
    on_disk: bool
    loaded: Loaded | None = None

    @property
    def name(self) -> str:
        return self.entry.path

    @property
    def rank(self) -> int | None:
        return self.entry.ranks[0] if len(self.entry.ranks) == 1 else None

    @property
    def role(self) -> str:
        return self.entry.role

    @property
    def state(self) -> Any:
        return self.loaded.state if self.loaded is not None and self.loaded.error is None else None

    def at(self, *parts) -> str:
        return json_path("files", self.index, *parts)


@dataclass
class _Context:
    manifest: Manifest
    tag_dir: Path
    verify_hashes: bool
    files: list[_File]
    disk: dict[str, Path]  # relative posix path -> file, sidecars excluded
    names: dict[str, tuple[str, int, int | None]] = field(default_factory=dict)  # name -> (role, group, index)

    @property
    def layout(self):
        return self.manifest.layout

    @property
    def world_size(self) -> int:
        return self.manifest.layout.world_size

    def readable(self, role: str) -> list[_File]:
        """Files of ``role`` that were read, by rank."""
        out = [f for f in self.files if f.role == role and f.state is not None]
        return sorted(out, key=lambda f: (f.rank if f.rank is not None else -1, f.name))

    def model_files(self) -> list[tuple[_File, dict]]:
        return [(f, f.state) for f in self.readable("model_states") if isinstance(f.state, dict)]

    def modules(self) -> list[tuple[_File, dict]]:
        return [(f, s["module"]) for f, s in self.model_files() if isinstance(s.get("module"), dict)]

    def optim_files(self) -> list[tuple[_File, dict]]:
        out = []
        for f in self.readable("optimizer_states"):
            osd = f.state.get("optimizer_state_dict") if isinstance(f.state, dict) else None
            if isinstance(osd, dict):
                out.append((f, osd))
        return out

    @property
    def flat_key(self) -> str:
        return "fp32_flat_groups" if self.layout.zero_stage == 3 else "single_partition_of_fp32_groups"

    @property
    def expected_version(self) -> str | None:
        producer = self.manifest.producer
        if producer.framework == "deepspeed" and producer.framework_version not in ("", "unknown"):
            return producer.framework_version
        return None


def _safe_join(tag_dir: Path, rel: str) -> Path | None:
    """The file a manifest path names, or None when it would leave the tag directory."""
    parts = rel.replace("\\", "/").split("/")
    if rel.startswith(("/", "\\")) or any(p in ("", ".", "..") for p in parts) or "\x00" in rel or ":" in parts[0]:
        return None
    return tag_dir.joinpath(*parts)


def _disk_files(tag_dir: Path) -> dict[str, Path]:
    out = {}
    for root, dirs, files in os.walk(tag_dir):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(tag_dir).as_posix()
            if rel in SIDECARS or not path.is_file():
                continue
            out[rel] = path
    return out


def _context(manifest: Manifest, tag_dir: Path, verify_hashes: bool, states: StateCache) -> _Context:
    files = []
    for i, entry in enumerate(manifest.files):
        path = _safe_join(tag_dir, entry.path)
        on_disk = path is not None and path.is_file()
        f = _File(i, entry, path, on_disk)
        if on_disk and entry.role in ("model_states", "optimizer_states"):
            f.loaded = states.load(path, members=entry.role == "optimizer_states")
        files.append(f)
    ctx = _Context(manifest, tag_dir, verify_hashes, files, _disk_files(tag_dir))
    for g, grp in enumerate(manifest.groups):
        for p, param in enumerate(grp.params):
            ctx.names[param.name] = ("trainable", g, p)
    for section, role in (("frozen", "frozen"), ("aliases", "alias"), ("buffers", "buffer"), ("excluded", "excluded")):
        for i, item in enumerate(getattr(manifest, section)):
            ctx.names.setdefault(item.name, (role, i, None))
    return ctx


def check_checkpoint(manifest: Manifest, tag_dir: str | os.PathLike, *, verify_hashes: bool = True,
                     states: StateCache | None = None) -> list[Finding]:
    """Check the files of ``tag_dir`` against ``manifest`` (which should already be valid).

    Reads only metadata, plus every file's bytes when ``verify_hashes`` and the manifest
    records hashes. Returns the findings of every check, in check order. ``states``: files
    already read, and where the files read here are kept.
    """
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CkptspecError("CK901", "checkpoint tag directory not found", "check the path", str(tag_dir))
    ctx = _context(manifest, tag_dir, verify_hashes, states if states is not None else StateCache())
    return [finding for c in CHECKS for finding in c.check(ctx)]


# --------------------------------------------------------------------------- naming helpers


def _optim_prefix(ctx: _Context) -> str:
    for f in ctx.files:
        if f.role == "optimizer_states" and (m := OPTIM_RE.match(Path(f.name).name)):
            return Path(f.name).name[: m.start(1)].removesuffix("zero_pp_rank_")
    return "bf16_" if ctx.layout.model_dtype == "bfloat16" else ""


def _expected_name(ctx: _Context, role: str, rank: int) -> str:
    if role == "optimizer_states":
        return f"{_optim_prefix(ctx)}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    if ctx.layout.zero_stage == 3:
        return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt"


def _rank_from_name(name: str) -> int | None:
    base = Path(name).name
    if m := OPTIM_RE.match(base):
        return int(m.group(1))
    if (m := MODEL_RE.match(base)) and m.group(1) is not None:
        return int(m.group(1))
    return None


def _expected_roles(ctx: _Context) -> list[tuple[str, int]]:
    """(role, rank) of every shard file the layout needs."""
    ws, stage = ctx.world_size, ctx.layout.zero_stage
    needed = [("model_states", r) for r in (range(ws) if stage == 3 else [0])]
    if stage >= 1:
        needed += [("optimizer_states", r) for r in range(ws)]
    return needed


# --------------------------------------------------------------------------- files


@check("CK206")
def shard_missing(ctx: _Context) -> Iterator[Finding]:
    """Every file the manifest lists exists, and the manifest lists every file the layout needs."""
    for f in ctx.files:
        if not f.on_disk:
            yield finding("CK206", f.at("path"), f"{f.role.replace('_', ' ')} file is missing", "restore the file from the run that wrote this checkpoint; "
                           "without it the weights of this rank are lost", file=f.name, rank=f.rank)
    listed = {(f.role, r) for f in ctx.files for r in f.entry.ranks}
    for role, rank in _expected_roles(ctx):
        if (role, rank) not in listed:
            name = _expected_name(ctx, role, rank)
            yield finding("CK206", json_path("files"), f"no {role.replace('_', ' ')} file for rank {rank} of {ctx.world_size}", "a ZeRO checkpoint has one such file per data-parallel rank; restore it from the run that wrote the checkpoint", file=name, rank=rank)


@check("CK207")
def shard_unexpected(ctx: _Context) -> Iterator[Finding]:
    """Nothing is present that the manifest does not list (a stale rank from a larger run, a stray copy)."""
    listed = {f.name for f in ctx.files}
    for rel in ctx.disk:
        if rel not in listed:
            rank = _rank_from_name(rel)
            why = (f"; rank {rank} is outside world size {ctx.world_size} (left over from a larger run?)"
                   if rank is not None and rank >= ctx.world_size else "")
            yield finding("CK207", "$", f"file is not part of this checkpoint's manifest{why}", "remove it, or regenerate the manifest if it belongs to the checkpoint; DeepSpeed's loaders glob "
                           "'*_optim_states.pt' and would pick it up", file=rel, rank=rank)
    for f in ctx.files:
        base = Path(f.name).name
        if f.role == "other" and base.endswith(("_optim_states.pt", "_model_states.pt")):
            yield finding("CK207", f.at("path"), "file looks like a DeepSpeed shard but is not one of this checkpoint's shards", "remove it: DeepSpeed's loaders glob '*_optim_states.pt' / '*_model_states.pt' and would read it", file=f.name)


@check("CK208")
def shard_size(ctx: _Context) -> Iterator[Finding]:
    for f in ctx.files:
        if f.on_disk:
            size = f.path.stat().st_size
            if size != f.entry.size:
                what = "truncated" if size < f.entry.size else "longer than recorded"
                yield finding("CK208", f.at("size"), f"file is {size} bytes, the manifest records {f.entry.size} ({what})", "the file was cut off or replaced after the manifest was written; restore it", file=f.name, rank=f.rank)


@check("CK209")
def shard_hash(ctx: _Context) -> Iterator[Finding]:
    if not ctx.verify_hashes:
        return
    for f in ctx.files:
        if f.on_disk and f.entry.hash is not None and f.path.stat().st_size == f.entry.size:
            actual = file_digest(f.path, f.entry.hash.algorithm)
            if actual.digest != f.entry.hash.digest:
                yield finding("CK209", f.at("hash"), f"{f.entry.hash.algorithm} of the file is {actual.digest[:16]}..., the manifest records "
                               f"{f.entry.hash.digest[:16]}...", "the content changed after the manifest was written (swapped rank files, a re-save, bit rot); restore it", file=f.name, rank=f.rank)


def _unreadable(ctx: _Context, code: str) -> Iterator[Finding]:
    for f in ctx.files:
        if f.loaded is not None and f.loaded.error is not None and code_and_hint(f.loaded.error)[0] == code:
            yield finding(code, f.at(), f.loaded.error.reason, code_and_hint(f.loaded.error)[1], file=f.name, rank=f.rank)


@check("CK204")
def unsafe_pickle(ctx: _Context) -> Iterator[Finding]:
    yield from _unreadable(ctx, "CK204")


@check("CK205")
def damaged_file(ctx: _Context) -> Iterator[Finding]:
    yield from _unreadable(ctx, "CK205")


def _archive_name(state: Any) -> str | None:
    for _, ref in torchfile.iter_tensor_refs(state):
        return ref.storage.member.split("/", 1)[0]
    return None


@check("CK210")
def shard_identity(ctx: _Context) -> Iterator[Finding]:
    """torch.save records the file name inside the zip: a DeepSpeed shard saved as another rank's file was moved."""
    for f in ctx.files:
        if f.state is None:
            continue
        archive = _archive_name(f.state)
        base = Path(f.name).name
        if archive is None or archive == base.removesuffix(".pt"):
            continue
        if OPTIM_RE.match(archive + ".pt") or MODEL_RE.match(archive + ".pt"):
            yield finding("CK210", f.at("path"), f"the file was saved as {archive}.pt (the name recorded inside it), not as {base}", "rank files were swapped or renamed; put each file back under the name it was saved as", file=f.name, rank=f.rank)


# --------------------------------------------------------------------------- headers


def _versions(state: dict, osd: dict | None = None) -> list[str]:
    out = [state.get("ds_version")]
    if osd is not None:
        out.append(osd.get("ds_version"))
    return [str(v) for v in out if v is not None]


@check("CK211")
def optimizer_header(ctx: _Context) -> Iterator[Finding]:
    """Every optimizer file agrees with the manifest (not only file 0): stage, partition count, group count, version."""
    layout, groups = ctx.layout, ctx.manifest.groups
    hint = "the optimizer files come from different runs or settings; restore the files of one save"
    bf16_opt = layout.optimizer == "BF16_Optimizer" or (layout.optimizer is None and layout.tail_padding_saved)
    for f in ctx.readable("optimizer_states"):
        state = f.state
        osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(osd, dict):
            yield finding("CK211", f.at(), "no 'optimizer_state_dict' in the file: not a DeepSpeed optimizer states file", hint, file=f.name, rank=f.rank)
            continue
        if "zero_stage" in osd:
            try:
                stage = int(osd["zero_stage"])
            except (TypeError, ValueError):
                stage = None
            if stage != layout.zero_stage:
                yield finding("CK211", json_path("layout", "zero_stage"), f"file says ZeRO stage {osd['zero_stage']!r}, the checkpoint is stage {layout.zero_stage}", hint, file=f.name, rank=f.rank)
        elif not bf16_opt:
            yield finding("CK211", json_path("layout", "zero_stage"), "file records no ZeRO stage", hint, file=f.name, rank=f.rank)
        counts = osd.get("partition_count")
        if layout.zero_stage == 3:
            if counts != layout.world_size or isinstance(counts, bool):
                yield finding("CK211", json_path("layout", "world_size"), f"file says partition count {counts!r}, the checkpoint has {layout.world_size} ranks", hint, file=f.name, rank=f.rank)
        else:
            expected = [g.partition_count for g in groups]
            if not isinstance(counts, list) or counts != expected:
                yield finding("CK211", json_path("groups"), f"file says partition counts {counts!r}, the manifest has {expected}", hint, file=f.name, rank=f.rank)
        flat = osd.get(ctx.flat_key)
        n = len(flat) if isinstance(flat, list) else None
        if n != len(groups):
            yield finding("CK211", json_path("groups"), f"file holds {n if n is not None else 'no'} flat groups ({ctx.flat_key}), the manifest has {len(groups)}", hint, file=f.name, rank=f.rank)
        expected_version = ctx.expected_version
        for version in set(_versions(state, osd)):
            if expected_version is not None and version != expected_version:
                yield finding("CK211", json_path("producer", "framework_version"), f"file was written by DeepSpeed {version}, the checkpoint by {expected_version}", hint, file=f.name, rank=f.rank)


def _param_shapes(ctx: _Context) -> list[list[tuple[str, list[int]]]]:
    return [[(p.name, list(p.shape)) for p in g.params] for g in ctx.manifest.groups]


def _as_shape(value) -> list[int] | None:
    try:
        return [int(d) for d in value]
    except (TypeError, ValueError):
        return None


@check("CK212")
def model_header(ctx: _Context) -> Iterator[Finding]:
    """Every model states file agrees with the manifest: param_shapes (names, order, shapes), frozen shapes, ties, buffers, world size, version."""
    hint = "the model states disagree with the manifest; restore the files of one save (or regenerate the manifest if it is stale)"
    expected_shapes = _param_shapes(ctx)
    fragment_frozen = {f.name: list(f.shape) for f in ctx.manifest.frozen if f.stored_in != "module"}
    aliases = {a.name: a.owner for a in ctx.manifest.aliases}
    buffers = {b.name for b in ctx.manifest.buffers}
    for f in ctx.readable("model_states"):
        state = f.state
        if not isinstance(state, dict) or not isinstance(state.get("module"), dict) or not isinstance(state.get("param_shapes"), list):
            yield finding("CK212", f.at(), "not a DeepSpeed model states file (no 'module' dict or no 'param_shapes' list)", hint, file=f.name, rank=f.rank)
            continue
        actual = []
        for group in state["param_shapes"]:
            items = group.items() if isinstance(group, dict) else []
            actual.append([(str(n), _as_shape(s)) for n, s in items])
        if actual != expected_shapes:
            yield finding("CK212", json_path("groups"), "param_shapes " + _first_difference(actual, expected_shapes), hint, file=f.name, rank=f.rank)
        ws = state.get("dp_world_size")
        if ws is not None and ws != ctx.world_size:
            yield finding("CK212", json_path("layout", "world_size"), f"file says data-parallel world size {ws!r}, the manifest {ctx.world_size}", hint, file=f.name, rank=f.rank)
        expected_version = ctx.expected_version
        version = state.get("ds_version")
        if expected_version is not None and version is not None and str(version) != expected_version:
            yield finding("CK212", json_path("producer", "framework_version"), f"file was written by DeepSpeed {version}, the checkpoint by {expected_version}", hint, file=f.name, rank=f.rank)
        frozen_shapes = state.get("frozen_param_shapes")
        if fragment_frozen or frozen_shapes:
            recorded = {str(n): _as_shape(s) for n, s in frozen_shapes.items()} if isinstance(frozen_shapes, dict) else {}
            recorded = {n: s for n, s in recorded.items() if n not in aliases}
            if recorded != fragment_frozen:
                yield finding("CK212", json_path("frozen"), "frozen_param_shapes " + _dict_difference(recorded, fragment_frozen), hint, file=f.name, rank=f.rank)
        shared = state.get("shared_params")
        if isinstance(shared, dict) and (f.rank in (0, None) or shared):
            # DeepSpeed computes the ties on global rank 0 only; the other ranks' files hold {}.
            real = _real_ties({str(k): str(v) for k, v in shared.items()}, state["module"], ctx.layout.zero_stage)
            if real != aliases:
                yield finding("CK212", json_path("aliases"), "shared_params " + _dict_difference(real, aliases), hint, file=f.name, rank=f.rank)
        names = state.get("buffer_names")
        if isinstance(names, list) and set(map(str, names)) != buffers:
            yield finding("CK212", json_path("buffers"), "buffer_names " + _dict_difference(dict.fromkeys(map(str, names)), dict.fromkeys(buffers)), hint, file=f.name, rank=f.rank)


def _first_difference(actual: list[list], expected: list[list]) -> str:
    if len(actual) != len(expected):
        return f"has {len(actual)} groups, the manifest {len(expected)}"
    for g, (a, e) in enumerate(zip(actual, expected)):
        if a == e:
            continue
        if [n for n, _ in a] == [n for n, _ in e]:
            k = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
            return f"group {g}: {a[k][0]} has shape {a[k][1]}, the manifest {e[k][1]}"
        if sorted(n for n, _ in a) == sorted(n for n, _ in e):
            k = next(i for i, (x, y) in enumerate(zip(a, e)) if x[0] != y[0])
            return f"group {g}: order differs at position {k}: {a[k][0]} where the manifest has {e[k][0]}"
        extra = sorted({n for n, _ in a} - {n for n, _ in e})
        missing = sorted({n for n, _ in e} - {n for n, _ in a})
        return f"group {g}: names differ (file only: {extra}, manifest only: {missing})"
    return "differs"


def _dict_difference(actual: dict, expected: dict) -> str:
    extra = sorted(set(actual) - set(expected))
    missing = sorted(set(expected) - set(actual))
    changed = sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k])
    parts = []
    if extra:
        parts.append(f"file only: {extra}")
    if missing:
        parts.append(f"manifest only: {missing}")
    if changed:
        parts.append("differ: " + ", ".join(f"{k} ({actual[k]!r} vs {expected[k]!r})" for k in changed))
    return "disagree with the manifest (" + "; ".join(parts) + ")"


# --------------------------------------------------------------------------- partitions


@check("CK213")
def partition_numel(ctx: _Context) -> Iterator[Finding]:
    """Each rank's flat master partition holds exactly the manifest's saved numel.

    Stage 1/2: the group padded to 2 x world size, split evenly, tail padding stripped
    (BF16_Optimizer keeps it); stage 3: ceil(numel / ws) per param, summed per sub-group,
    identical on every rank.
    """
    master = ctx.layout.master_dtype
    for f, osd in ctx.optim_files():
        flat = osd.get(ctx.flat_key)
        if not isinstance(flat, list) or f.rank is None:
            continue
        for g, (ref, grp) in enumerate(zip(flat, ctx.manifest.groups)):
            path = json_path("groups", g, "saved_numels", f.rank) if f.rank < len(grp.saved_numels) else json_path("groups", g)
            if not isinstance(ref, torchfile.TensorRef):
                yield finding("CK213", path, f"{ctx.flat_key}[{g}] is not a tensor", "restore the file", file=f.name, rank=f.rank)
                continue
            expected = grp.saved_numels[f.rank] if f.rank < len(grp.saved_numels) else None
            if len(ref.shape) != 1 or ref.numel != expected:
                rule = ("ceil(numel / world size) per param" if grp.partitioning == "per_param"
                        else f"the group padded to {grp.alignment} and split {grp.partition_count} ways")
                yield finding("CK213", path, f"group {g}: the flat partition holds {ref.numel} elements (shape {list(ref.shape)}), "
                               f"the manifest arithmetic ({rule}) gives {expected}", "the file belongs to another run or layout, or param_shapes is corrupt; a reconstruction would shift weights", file=f.name, rank=f.rank)
            if ref.dtype != master:
                yield finding("CK213", json_path("layout", "master_dtype"), f"group {g}: the flat partition is {ref.dtype}, the manifest's master dtype is {master}", "the file belongs to another run or layout", file=f.name, rank=f.rank)


@check("CK214")
def partition_locator(ctx: _Context) -> Iterator[Finding]:
    """The manifest's byte locators point at the flat partitions' real bytes."""
    for f, osd in ctx.optim_files():
        flat = osd.get(ctx.flat_key)
        members = f.loaded.members or {}
        if not isinstance(flat, list):
            continue
        for k, loc in enumerate(f.entry.partitions):
            ref = flat[loc.group] if loc.group < len(flat) else None
            if not isinstance(ref, torchfile.TensorRef):
                continue
            real = (ref.storage.member, *members.get(ref.storage.member, (None, None)), ref.dtype, ref.storage_offset, ref.numel)
            recorded = (loc.member, loc.data_offset, loc.member_size, loc.dtype, loc.element_offset, loc.numel)
            if real != recorded or loc.rank != f.rank:
                fields = ("member", "data_offset", "member_size", "dtype", "element_offset", "numel")
                diff = ", ".join(f"{n} {r!r} (manifest {m!r})" for n, r, m in zip(fields, real, recorded) if r != m)
                yield finding("CK214", f.at("partitions", k), f"group {loc.group}: the locator does not match the partition in the file: {diff or f'rank {loc.rank}'}", "a reader following this locator would read the wrong bytes; regenerate the manifest or restore the file", file=f.name, rank=f.rank)


# --------------------------------------------------------------------------- module


@check("CK215")
def module_role(ctx: _Context) -> Iterator[Finding]:
    """Every 'module' key has exactly one role (trainable, frozen, alias, buffer), so nothing is silently dropped."""
    declared = {n: role for n, (role, _, _) in ctx.names.items() if role != "excluded"}
    for f, module in ctx.modules():
        for key in module:
            role = ctx.names.get(key, (None,))[0]
            if role is None or role == "excluded":
                why = "is declared excluded" if role == "excluded" else "has no role in the manifest"
                yield finding("CK215", json_path(), f"module key {key!r} {why} (not trainable, frozen, alias or buffer)", "a reconstruction would silently drop this tensor; zero_to_fp32 drops it too. Is a tie "
                               "(shared_params) or frozen_param_shapes missing?", file=f.name, rank=f.rank)
        for name, role in declared.items():
            if name not in module:
                yield finding("CK215", _name_path(ctx, name), f"{role} {name!r} is declared but not in the saved module", "the manifest describes a different model than this checkpoint", file=f.name, rank=f.rank)


def _name_path(ctx: _Context, name: str, *suffix) -> str:
    role, i, j = ctx.names[name]
    if role == "trainable":
        return json_path("groups", i, "params", j, *suffix)
    section = {"frozen": "frozen", "alias": "aliases", "buffer": "buffers", "excluded": "excluded"}[role]
    return json_path(section, i, *suffix)


@check("CK216")
def module_shape(ctx: _Context) -> Iterator[Finding]:
    """The saved module tensors have the recorded shapes (catches a transposed shape in param_shapes)."""
    stage3 = ctx.layout.zero_stage == 3
    expected: dict[str, tuple[list[int], str | None]] = {}
    if not stage3:  # stage 3 saves (0,) placeholders for every parameter
        for grp in ctx.manifest.groups:
            for p in grp.params:
                expected[p.name] = (list(p.shape), p.dtype)
        for fr in ctx.manifest.frozen:
            expected[fr.name] = (list(fr.shape), None)
        for a in ctx.manifest.aliases:
            expected[a.name] = (list(a.shape), None)
    for b in ctx.manifest.buffers:
        expected[b.name] = (list(b.shape), b.dtype)
    for f, module in ctx.modules():
        for name, (shape, dtype) in expected.items():
            ref = module.get(name)
            if not isinstance(ref, torchfile.TensorRef):
                continue  # CK215 reports missing keys
            if list(ref.shape) != shape:
                yield finding("CK216", _name_path(ctx, name, "shape"), f"{name}: the saved tensor has shape {list(ref.shape)}, the manifest records {shape}", "param_shapes (or the manifest) records a wrong shape; a reconstruction would return a wrongly shaped tensor", file=f.name, rank=f.rank)
            elif dtype is not None and ref.dtype != dtype:
                yield finding("CK216", _name_path(ctx, name, "dtype"), f"{name}: the saved tensor is {ref.dtype}, the manifest records {dtype}", "the manifest describes a different run", file=f.name, rank=f.rank)


@check("CK217")
def module_layout(ctx: _Context) -> Iterator[Finding]:
    """Stage 1/2 save the module's trainable tensors as views into the flat buffer: their offsets are the real layout.

    Catches reordered param_shapes (and a wrong round-robin order). Groups whose tensors
    do not share a storage (not a flat-view save) are skipped.
    """
    if ctx.layout.zero_stage == 3:
        return
    for f, module in ctx.modules():
        for g, grp in enumerate(ctx.manifest.groups):
            refs = [(j, p, module.get(p.name)) for j, p in enumerate(grp.params)]
            refs = [(j, p, r) for j, p, r in refs if isinstance(r, torchfile.TensorRef) and r.numel > 0]
            counts = Counter(r.storage.key for _, _, r in refs)
            if not counts or counts.most_common(1)[0][1] < 2:
                continue
            flat_key = counts.most_common(1)[0][0]
            flat_numel = next(r.storage.numel for _, _, r in refs if r.storage.key == flat_key)
            if flat_numel != grp.padded_numel:
                yield finding("CK217", json_path("groups", g, "padded_numel"), f"group {g}: the module's flat buffer holds {flat_numel} elements, the manifest's padded group {grp.padded_numel}", "param_shapes does not describe this flat buffer (wrong shapes, paddings or world size)", file=f.name, rank=f.rank)
            for j, p, r in refs:
                if r.storage.key != flat_key:
                    yield finding("CK217", json_path("groups", g, "params", j), f"{p.name} is not a view into group {g}'s flat buffer", "the module tensors do not come from this group", file=f.name, rank=f.rank)
                elif r.storage_offset != p.offset or not r.is_contiguous():
                    yield finding("CK217", json_path("groups", g, "params", j, "offset"), f"{p.name} sits at element {r.storage_offset} of group {g}'s flat buffer, the manifest says {p.offset}", "the recorded parameter order or paddings differ from the real flat layout; a reconstruction "
                                   "would return other parameters' values under these names", file=f.name, rank=f.rank)


def expected_slice_mappings(manifest: Manifest, g: int, rank: int) -> list[tuple[str, int, int]]:
    """``param_slice_mappings[g]`` as DeepSpeed 0.19 writes it for ``rank``: (name, numel, start).

    DeepSpeed walks the params in their natural (optimizer) order. Without alignment
    paddings it counts offsets sequentially in that order, so for round-robin checkpoints
    the mappings do not describe the flat buffer (notes §4 #10); with paddings it uses the
    real offsets.
    """
    grp = manifest.groups[g]
    start, end = rank * grp.partition_numel, (rank + 1) * grp.partition_numel
    params = list(grp.params)
    if manifest.layout.round_robin:
        params = natural_order(params, grp.partition_count)
    real_offsets = any(p.padding for p in grp.params) or not manifest.layout.round_robin
    out, cursor = [], 0
    for p in params:
        offset = p.offset if real_offsets else cursor
        p_end = offset + p.numel
        if p.numel > 0 and (start <= offset < end or offset < start < p_end):
            lo, hi = max(offset, start), min(p_end, end)
            out.append((p.name, hi - lo, lo - start))
        cursor += p.numel
    return out


@check("CK218")
def slice_mappings(ctx: _Context) -> Iterator[Finding]:
    """Each rank's param_slice_mappings agree with the recorded order and offsets (stage 1/2).

    Round robin: DeepSpeed computes the mappings over the natural parameter order, so they
    are compared with that (they then disagree with the flat buffer; see docs/validation.md).
    """
    if ctx.layout.zero_stage == 3:
        return
    for f, osd in ctx.optim_files():
        mappings = osd.get("param_slice_mappings")
        if mappings is None or f.rank is None or f.rank >= ctx.world_size:
            continue
        if not isinstance(mappings, list) or len(mappings) != len(ctx.manifest.groups):
            n = len(mappings) if isinstance(mappings, list) else type(mappings).__name__
            yield finding("CK218", json_path("groups"), f"param_slice_mappings has {n} groups, the manifest {len(ctx.manifest.groups)}", "the file belongs to another run or layout", file=f.name, rank=f.rank)
            continue
        for g, mapping in enumerate(mappings):
            if f.rank >= ctx.manifest.groups[g].partition_count:
                continue
            actual = []
            for name, addr in (mapping.items() if isinstance(mapping, dict) else []):
                actual.append((str(name), getattr(addr, "numel", None), getattr(addr, "start", None)))
            expected = expected_slice_mappings(ctx.manifest, g, f.rank)
            if actual != expected:
                yield finding("CK218", json_path("groups", g, "params"), f"group {g}: param_slice_mappings " + _mapping_difference(actual, expected), "the recorded parameter order or offsets differ from the file's own mapping; a reconstruction "
                               "(or ds_to_universal) would read the wrong slices", file=f.name, rank=f.rank)


def _mapping_difference(actual: list, expected: list) -> str:
    for a, e in zip(actual, expected):
        if a != e:
            return (f"has {a[0]} (numel {a[1]}, start {a[2]}) where the manifest implies "
                    f"{e[0]} (numel {e[1]}, start {e[2]})")
    if len(actual) > len(expected):
        return f"has extra entry {actual[len(expected)][0]}"
    return f"lacks {expected[len(actual)][0]} (numel {expected[len(actual)][1]}, start {expected[len(actual)][2]})"


def _same_view(a: torchfile.TensorRef, b: torchfile.TensorRef, stage3: bool) -> bool:
    if stage3:  # (0,) placeholders: tied params share the placeholder's storage
        return a.storage.key == b.storage.key
    return (a.storage.key, a.storage_offset, a.shape, a.stride) == (b.storage.key, b.storage_offset, b.shape, b.stride)


@check("CK219")
def alias_tie(ctx: _Context) -> Iterator[Finding]:
    """An alias's owner exists and the saved tensors really are one tensor; no tie goes undeclared."""
    stage3 = ctx.layout.zero_stage == 3
    owners = {a.name: a.owner for a in ctx.manifest.aliases}
    for f, module in ctx.modules():
        for i, a in enumerate(ctx.manifest.aliases):
            ref, owner = module.get(a.name), module.get(a.owner)
            if a.owner not in ctx.names or ctx.names[a.owner][0] in ("alias", "excluded"):
                yield finding("CK219", json_path("aliases", i, "owner"), f"alias {a.name!r} points to {a.owner!r}, which is not a parameter or buffer of the checkpoint", "the tie cannot be restored; check shared_params", file=f.name, rank=f.rank)
            elif not isinstance(owner, torchfile.TensorRef):
                yield finding("CK219", json_path("aliases", i, "owner"), f"alias {a.name!r}: its owner {a.owner!r} is not in the saved module", "the tie cannot be restored; check shared_params", file=f.name, rank=f.rank)
            elif not stage3 and isinstance(ref, torchfile.TensorRef) and ref.numel > 0 and not _same_view(ref, owner, stage3):
                # (Stage 3 placeholders of tied params share a storage only as DeepSpeed saved them; a
                # re-save by torch splits empty storages, so a missing share is no evidence there.)
                yield finding("CK219", json_path("aliases", i, "owner"), f"alias {a.name!r} is not the same tensor as its owner {a.owner!r} in the saved module", "shared_params names the wrong owner; a reconstruction would copy another tensor's values", file=f.name, rank=f.rank)
        # Undeclared ties: tensors that are one tensor in the module but not declared aliases.
        params = {n for n, (role, _, _) in ctx.names.items() if role in ("trainable", "frozen", "alias")}
        params |= {n for n in module if n not in ctx.names}
        seen: dict[Any, str] = {}
        for name in module:
            ref = module[name]
            if name not in params or not isinstance(ref, torchfile.TensorRef) or (ref.numel == 0 and not stage3):
                continue
            key = ref.storage.key if stage3 else (ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
            first = seen.setdefault(key, name)
            if first != name and owners.get(name, name) != owners.get(first, first):
                yield finding("CK219", json_path("aliases"), f"{name!r} is the same tensor as {first!r} in the saved module, but no alias declares the tie", f"declare {name!r} an alias of {first!r} (was shared_params emptied?)", file=f.name, rank=f.rank)


@check("CK220")
def frozen_fragments(ctx: _Context) -> Iterator[Finding]:
    """Frozen parameters are saved where the manifest says: full fragments (stage 2), a partition per rank (stage 3)."""
    ws = ctx.world_size
    for f, state in ctx.model_files():
        fragments = state.get("frozen_param_fragments")
        fragments = fragments if isinstance(fragments, dict) else {}
        for i, fr in enumerate(ctx.manifest.frozen):
            if fr.stored_in == "module":
                continue
            ref = fragments.get(fr.name)
            path = json_path("frozen", i)
            if not isinstance(ref, torchfile.TensorRef):
                yield finding("CK220", path, f"frozen parameter {fr.name!r} has no fragment in frozen_param_fragments", "the frozen weight is not in this file; a reconstruction would fail or drop it", file=f.name, rank=f.rank)
                continue
            if fr.stored_in == "partitioned_fragments":
                share = -(-fr.numel // ws)
                if ref.numel != share or len(ref.shape) != 1:
                    yield finding("CK220", path, f"frozen {fr.name!r}: this rank's fragment has shape {list(ref.shape)}, "
                                   f"ceil({fr.numel} / {ws}) gives ({share},)", "the fragment belongs to another run or layout", file=f.name, rank=f.rank)
            elif list(ref.shape) != list(fr.shape):
                yield finding("CK220", path + ".shape", f"frozen {fr.name!r}: the fragment has shape {list(ref.shape)}, the manifest records {list(fr.shape)}", "the fragment belongs to another run, or the manifest is wrong", file=f.name, rank=f.rank)
            if ref.dtype != fr.dtype:
                yield finding("CK220", path + ".dtype", f"frozen {fr.name!r}: the fragment is {ref.dtype}, the manifest records {fr.dtype}", "the fragment belongs to another run", file=f.name, rank=f.rank)


# --------------------------------------------------------------------------- the whole flow


def find_sidecar(tag_dir: Path) -> Path | None:
    """The manifest embedded in a tag directory (``ckptspec.json`` or ``ckptspec.msgpack``)."""
    for name in SIDECARS:
        if (tag_dir / name).is_file():
            return tag_dir / name
    return None


def _role_of(name: str) -> tuple[str, list[int]]:
    base = Path(name).name
    if m := OPTIM_RE.match(base):
        return "optimizer_states", [int(m.group(1))]
    if m := MODEL_RE.match(base):
        return "model_states", [int(m.group(1) or 0)]
    return "other", []


def _read_finding(rel: str, loaded: Loaded) -> Finding:
    code, hint = code_and_hint(loaded.error)
    return finding(code, "$", loaded.error.reason, hint, file=rel, rank=_rank_from_name(rel))


def _generate(tag_dir: Path) -> tuple[Manifest | None, list[Finding], StateCache]:
    """A manifest from DeepSpeed's own metadata, tolerant of unreadable files.

    Files that cannot be read are left out of the derivation but listed (without
    locators), so that the checks name them. File entries for ranks outside the world
    size are dropped, so that the checks report those files as unexpected.
    Returns (None, findings, cache) when no manifest can be derived.
    """
    shards = scan_tag_dir(tag_dir)  # raises CK202 / CK203
    cache = StateCache()
    readable = ShardSet(tag_dir, other_files=list(shards.other_files))
    unreadable: dict[str, Loaded] = {}
    for role, mapping, target in (("model_states", shards.model_files, readable.model_files),
                                  ("optimizer_states", shards.optim_files, readable.optim_files)):
        for rank, path in mapping.items():
            loaded = cache.load(path, members=role == "optimizer_states")
            if loaded.error is None:
                target[rank] = path
            else:
                unreadable[path.relative_to(tag_dir).as_posix()] = loaded
    read_findings = [_read_finding(rel, loaded) for rel, loaded in unreadable.items()]
    if unreadable and (not readable.model_files or (shards.optim_files and not readable.optim_files)):
        return None, read_findings, cache
    try:
        manifest = manifest_from_states(readable, cache)
    except CkptspecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:
        rel = readable.model_files[min(readable.model_files)].relative_to(tag_dir).as_posix()
        return None, read_findings + [finding("CK212", "$", f"cannot derive the layout from DeepSpeed's metadata ({type(exc).__name__}: {str(exc)[:200]})", "the model or optimizer states are corrupt; restore the files of one save", file=rel, rank=_rank_from_name(rel))], cache
    ws, stage = manifest.layout.world_size, manifest.layout.zero_stage
    kept = []
    for entry in manifest.files:
        if entry.role == "optimizer_states" and entry.ranks[0] >= ws:
            continue
        if entry.role == "model_states" and (entry.ranks[0] >= (ws if stage == 3 else 1)
                                             or (stage == 3) != Path(entry.path).name.startswith("zero_pp_rank_")):
            continue
        kept.append(entry)
    for rel in unreadable:
        role, ranks = _role_of(rel)
        if ranks and ranks[0] < ws:
            kept.append(ShardFile(path=rel, role=role, ranks=ranks, size=(tag_dir / rel).stat().st_size, partitions=[]))
    order = {"model_states": 0, "optimizer_states": 1}
    manifest.files = sorted(kept, key=lambda e: (order.get(e.role, 2), e.ranks, e.path))
    return manifest, [], cache


def validate_checkpoint(checkpoint_dir: str | os.PathLike, manifest: Manifest | None = None, tag: str | None = None,
                        *, verify_hashes: bool = True) -> tuple[Manifest | None, list[Finding]]:
    """Validate a DeepSpeed checkpoint directory: the whole flow.

    Resolves the tag (``tag``, else ``latest``, else the directory itself), takes
    ``manifest``, else the sidecar ``ckptspec.json``/``ckptspec.msgpack`` of the tag
    directory, else a manifest generated from DeepSpeed's metadata; validates the manifest
    (schema and rules) and then checks the files against it.

    Returns (manifest, findings); the manifest is None when none could be had.
    Raises ``InvalidCheckpoint`` (exit 1) when the checkpoint cannot be checked at all
    (a bad ``latest``, no model states, an unsupported layout) and ``CkptspecError``
    (exit 2) when the directory or sidecar cannot be read.
    """
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    cache = StateCache()
    if manifest is not None:
        findings = validate_manifest(manifest).findings
        if has_errors(findings):
            return manifest, findings
    elif (sidecar := find_sidecar(tag_dir)) is not None:
        report = validate_file(sidecar)
        findings = [_in_file(f, sidecar.name) for f in report.findings]
        if report.manifest is None or has_errors(findings):
            return report.manifest, findings
        manifest = report.manifest
    else:
        manifest, findings, cache = _generate(tag_dir)
        if manifest is None:
            return None, findings
        # Rules on the file list would only repeat what the shard checks say better.
        doc = manifest.to_dict()
        doc["files"] = []
        findings = validate_manifest(manifest, doc).findings
    if not manifest.files:
        # A manifest of the layout only (e.g. from the live engine): take the files from the directory.
        described, unreadable, cache = _generate(tag_dir)
        if described is None:
            return manifest, findings + unreadable
        manifest = manifest.model_copy(update={"files": described.files})
    findings += check_checkpoint(manifest, tag_dir, verify_hashes=verify_hashes, states=cache)
    # Copies embedded in the model states (client_state) must agree with each other and the sidecar.
    from ..checkpoint.embedded import embedded_findings

    # The model states were read above: a second unpickling costs as much as the first.
    findings += embedded_findings(tag_dir, states=cache)
    return manifest, findings


def _in_file(finding: Finding, name: str) -> Finding:
    return finding if finding.file is not None else dataclasses.replace(finding, file=name)


__all__ = ["CHECKS", "check_checkpoint", "validate_checkpoint", "find_sidecar", "expected_slice_mappings", "SIDECARS"]

"""What every CK2xx check reads: the manifest, its files as found on disk and as decoded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...._fs import is_leftover
from ....checkpoint.before_embed import Earlier, recorded_before_embed
from ....checkpoint.embedded import CLIENT_STATE_KEY
from ....checkpoint.sidecar import SIDECAR_NAMES
from ....checkpoint.states import Loaded, StateCache
from ....findings import Finding, json_path
from ....format.models import Manifest, ShardFile
from ....format.paths import join_inside
from ....location import RemotePath, walk
from ...describe.digests import Covered, covered_tensors, recorded
from ...layout.names import expected_name, mp_rank_of, optim_prefix
from .hash_pass import hashes_and_digests

Check = Callable[["Context"], Iterator[Finding]]


@dataclass
class File:
    """One file the manifest lists: where it is, and what reading it gave (model and optimizer states)."""

    index: int  # position in manifest.files
    entry: ShardFile
    path: Path | RemotePath | None  # None when the manifest path would leave the tag directory
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
class Context:
    manifest: Manifest
    tag_dir: Path | RemotePath
    verify_hashes: bool
    files: list[File]
    disk: dict[str, Path | RemotePath]  # relative posix path -> file, sidecars excluded
    verify_digests: bool = False  # read every located tensor to check format 1.1's digests (CK222)
    names: dict[str, tuple[str, int, int | None]] = field(default_factory=dict)  # name -> (role, index, param index)
    # A model-states file `ckptspec embed` rewrote after the manifest was written, proven to be the
    # recorded file plus the embedded manifest (file index -> that file): the manifest is stale (CK227).
    before_embed: dict[int, Earlier] = field(default_factory=dict)
    embedded_since: dict[int, int] = field(default_factory=dict)  # file index -> embeds it carries, unproven
    _digested: list[tuple[Covered, str]] | None = None
    _read_once: tuple[dict[str, str], list[str]] | None = None

    @property
    def layout(self):
        return self.manifest.layout

    @property
    def world_size(self) -> int:
        return self.manifest.layout.world_size

    def readable(self, role: str) -> list[File]:
        """Files of ``role`` that were read, by rank."""
        out = [f for f in self.files if f.role == role and f.state is not None]
        return sorted(out, key=lambda f: (f.rank if f.rank is not None else -1, f.name))

    def model_files(self) -> list[tuple[File, dict]]:
        return [(f, f.state) for f in self.readable("model_states") if isinstance(f.state, dict)]

    def modules(self) -> list[tuple[File, dict]]:
        return [(f, s["module"]) for f, s in self.model_files() if isinstance(s.get("module"), dict)]

    def optim_files(self) -> list[tuple[File, dict]]:
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

    def needed_files(self) -> list[tuple[str, int]]:
        """(role, rank) of every shard file the layout needs."""
        ws, stage = self.world_size, self.layout.zero_stage
        needed = [("model_states", r) for r in (range(ws) if stage == 3 else [0])]
        if stage >= 1:
            needed += [("optimizer_states", r) for r in range(ws)]
        return needed

    def expected_name(self, role: str, rank: int) -> str:
        """The name DeepSpeed gives the missing ``role`` file of ``rank`` in this checkpoint."""
        prefix = optim_prefix((f.name for f in self.files if f.role == "optimizer_states"), self.layout.model_dtype)
        # A domain of a checkpoint index names its model-parallel rank in its files' names.
        mp_ranks = {r for f in self.files if (r := mp_rank_of(f.name)) is not None}
        mp_rank = mp_ranks.pop() if len(mp_ranks) == 1 else 0
        return expected_name(role, rank, self.layout.zero_stage, prefix, mp_rank)

    def hashed_files(self) -> list[File]:
        """The files whose recorded hash CK209 checks: present, of the recorded size."""
        if not self.verify_hashes:
            return []
        return [
            f
            for f in self.files
            if f.on_disk and f.path is not None and f.entry.hash is not None and f.path.stat().st_size == f.entry.size
        ]

    def digested(self) -> list[tuple[Covered, str]]:
        """(tensor, recorded sha256) of every digest CK222 checks: of an algorithm this reader knows,
        its bytes in files neither missing nor of another size (CK206/CK208 report those)."""
        if not self.verify_digests:
            return []
        if self._digested is None:
            readable = {
                f.name for f in self.files if f.on_disk and f.path is not None and f.path.stat().st_size == f.entry.size
            }
            self._digested = []
            for covered in covered_tensors(self.manifest):
                want = recorded(self.manifest, covered.where)
                if want is not None and want.sha256 is not None and {p for p, _, _ in covered.ranges} <= readable:
                    self._digested.append((covered, want.sha256))
        return self._digested

    def read_once(self) -> tuple[dict[str, str], list[str]]:
        """A remote checkpoint's file hashes (by name) and the digests of ``digested()``, from one read
        of its bytes (``hash_pass``), made once, for CK209 and CK222."""
        if self._read_once is None:
            assert isinstance(self.tag_dir, RemotePath)  # called for a checkpoint at a URL only
            hashed = {f.name: f.entry.hash.algorithm for f in self.hashed_files() if f.entry.hash is not None}
            order = [f.name for f in self.files if f.on_disk and f.path is not None]
            self._read_once = hashes_and_digests(self.tag_dir, order, hashed, [c for c, _ in self.digested()])
        return self._read_once

    def name_path(self, name: str, *suffix) -> str:
        """The JSON path of the manifest entry that declares ``name``."""
        role, i, j = self.names[name]
        if role == "trainable":
            assert j is not None  # a trainable parameter's place in its group
            return json_path("groups", i, "params", j, *suffix)
        section = {"frozen": "frozen", "alias": "aliases", "buffer": "buffers", "excluded": "excluded"}[role]
        return json_path(section, i, *suffix)


def disk_files(tag_dir: Path | RemotePath) -> dict[str, Path | RemotePath]:
    """Every file below ``tag_dir`` but the sidecar and ckptspec's leftovers, by relative posix path, sorted."""
    out = {}
    for root, _, files in walk(tag_dir):
        for name in files:
            path = root / name
            rel = path.relative_to(tag_dir).as_posix()  # type: ignore[arg-type]  # walk(tag_dir): of its kind
            if rel in SIDECAR_NAMES.values() or is_leftover(name) or not path.is_file():
                continue  # the sidecar describes the rest; leftovers of killed runs are CK224
            out[rel] = path
    return out


def build_context(
    manifest: Manifest,
    tag_dir: Path | RemotePath,
    verify_hashes: bool,
    states: StateCache,
    verify_digests: bool = False,
    scope: Callable[[str], bool] | None = None,
) -> Context:
    files = []
    for i, entry in enumerate(manifest.files):
        path = join_inside(tag_dir, entry.path)
        files.append(File(i, entry, path, path is not None and path.is_file()))
    read = [f for f in files if f.on_disk and f.entry.role in ("model_states", "optimizer_states")]
    states.load_all([f.path for f in read])  # each unpickled behind a forked opcode walk: sooner, the same
    for f in read:
        assert f.path is not None  # on disk
        f.loaded = states.load(f.path, members=True)
    disk = disk_files(tag_dir)
    if scope is not None:  # a domain of a checkpoint index: the other files are the index's to check
        disk = {rel: path for rel, path in disk.items() if scope(rel)}
    ctx = Context(manifest, tag_dir, verify_hashes, files, disk, verify_digests)
    _rewritten_by_embed(ctx)
    for g, grp in enumerate(manifest.groups):
        for p, param in enumerate(grp.params):
            ctx.names[param.name] = ("trainable", g, p)
    for section, role in (("frozen", "frozen"), ("aliases", "alias"), ("buffers", "buffer"), ("excluded", "excluded")):
        for i, item in enumerate(getattr(manifest, section)):
            ctx.names.setdefault(item.name, (role, i, None))
    return ctx


def _rewritten_by_embed(ctx: Context) -> None:
    """Fill ``ctx.before_embed`` and ``ctx.embedded_since``: the model-states files whose size differs
    from the record and that carry a manifest ``ckptspec embed`` appended (only those are read)."""
    for f in ctx.files:
        state = f.state
        if f.role != "model_states" or not isinstance(state, dict) or CLIENT_STATE_KEY not in state:
            continue
        assert f.loaded is not None and f.path is not None  # a model-states file read (it has a state)
        if not f.loaded.members or f.path.stat().st_size == f.entry.size:
            continue
        recorded = f.entry.hash if ctx.verify_hashes else None
        try:
            earlier, embeds = recorded_before_embed(f.path, f.loaded.members, CLIENT_STATE_KEY, f.entry.size, recorded)
        except (OSError, ValueError):
            continue  # not rebuilt: the file is judged as it is (CK208)
        if earlier is not None:
            ctx.before_embed[f.index] = earlier
        elif embeds:
            ctx.embedded_since[f.index] = embeds

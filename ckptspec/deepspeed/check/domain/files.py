"""CK204-CK210: the files themselves: present, expected, intact, readable, under their own names."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...._fs import JOURNAL, leftovers
from ....checkpoint.hashing import file_digests
from ....checkpoint.output_names import is_output_name
from ....checkpoint.states import code_and_hint
from ....checkpoint.torchfile import iter_tensor_refs
from ....findings import Finding, RuleSet, finding, json_path
from ....location import RemotePath
from ...layout.names import MODEL_RE, OPTIM_RE, rank_of
from .context import Check, Context

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register


@check("CK206")
def shard_missing(ctx: Context) -> Iterator[Finding]:
    """Every file the manifest lists exists, and the manifest lists every file the layout needs."""
    for f in ctx.files:
        if not f.on_disk:
            yield finding(
                "CK206",
                f.at("path"),
                f"{f.role.replace('_', ' ')} file is missing",
                "restore the file from the run that wrote this checkpoint; "
                "without it the weights of this rank are lost",
                file=f.name,
                rank=f.rank,
            )
    listed = {(f.role, r) for f in ctx.files for r in f.entry.ranks}
    for role, rank in ctx.needed_files():
        if (role, rank) not in listed:
            name = ctx.expected_name(role, rank)
            yield finding(
                "CK206",
                json_path("files"),
                f"no {role.replace('_', ' ')} file for rank {rank} of {ctx.world_size}",
                "a ZeRO checkpoint has one such file per data-parallel rank; restore it from the run that wrote "
                "the checkpoint",
                file=name,
                rank=rank,
            )


@check("CK207")
def shard_unexpected(ctx: Context) -> Iterator[Finding]:
    """Nothing is present that the manifest does not list (a stale rank from a larger run, a stray copy)."""
    listed = {f.name for f in ctx.files}
    for rel in ctx.disk:
        if rel not in listed and not is_output_name(rel):  # a reconstruction's output: CK226
            rank = rank_of(rel)
            why = (
                f"; rank {rank} is outside world size {ctx.world_size} (left over from a larger run?)"
                if rank is not None and rank >= ctx.world_size
                else ""
            )
            yield finding(
                "CK207",
                "$",
                f"file is not part of this checkpoint's manifest{why}",
                "remove it, or regenerate the manifest if it belongs to the checkpoint" + _globbed_by(rel),
                file=rel,
                rank=rank,
            )
    for f in ctx.files:
        base = Path(f.name).name
        if f.role == "other" and base.endswith(("_optim_states.pt", "_model_states.pt")):
            yield finding(
                "CK207",
                f.at("path"),
                "file looks like a DeepSpeed shard but is not one of this checkpoint's shards",
                "remove it" + _globbed_by(f.name),
                file=f.name,
            )


@check("CK226")
def output_in_tag_dir(ctx: Context) -> Iterator[Finding]:
    yield from outputs_in_tag_dir(ctx.disk)


def outputs_in_tag_dir(disk) -> Iterator[Finding]:
    """A file named like ``reconstruct``'s output (``model.safetensors``, ...) in the tag directory: no
    part of the checkpoint (a warning: DeepSpeed reads none of these names), listed or not."""
    for rel in disk:
        if is_output_name(rel):
            yield finding(
                "CK226",
                "$",
                "a reconstruction's output (weights in Hugging Face's names) inside the checkpoint's tag directory; "
                "DeepSpeed does not read it, and it is no part of the checkpoint",
                "move it out of the tag directory (`ckptspec reconstruct` writes elsewhere: into the save directory, "
                "or a directory of its own)",
                severity="warning",
                file=rel,
            )


@check("CK224")
def leftover_temporary(ctx: Context) -> Iterator[Finding]:
    """A ckptspec write that was killed left a temporary file or directory (or an unfinished
    commit) in the tag directory or its save directory: not part of the checkpoint, but space."""
    save_dir = ctx.tag_dir.parent if (ctx.tag_dir.parent / "latest").is_file() else None
    for directory in (ctx.tag_dir, save_dir):
        for path in leftovers(directory) if directory is not None else []:
            name = path.name if directory == ctx.tag_dir else f"../{path.name}"
            what = "an unfinished commit" if path.name == JOURNAL else "a temporary"
            hint = (
                "the next ckptspec write here finishes it (`ckptspec embed` on this checkpoint)"
                if path.name == JOURNAL
                else "the next ckptspec write in that directory removes it if its writer is gone; or delete it"
            )
            yield finding(
                "CK224",
                "$",
                f"{what} of a ckptspec run that did not finish (killed?)",
                hint,
                severity="warning",
                file=name,
            )


def _globbed_by(rel: str) -> str:
    """What DeepSpeed would do with a stray file: zero_to_fp32 globs '*_optim_states.pt' and
    '*_model_states.pt' in the tag directory itself (not its subfolders)."""
    for pattern in ("_optim_states.pt", "_model_states.pt"):
        if "/" not in rel and rel.endswith(pattern):
            return f"; DeepSpeed's zero_to_fp32 globs '*{pattern}' in the tag directory and would read it"
    return ""


@check("CK208")
def shard_size(ctx: Context) -> Iterator[Finding]:
    for f in ctx.files:
        if f.on_disk and f.path is not None and f.index not in ctx.before_embed:  # CK227: stale manifest, intact file
            size = f.path.stat().st_size
            if size != f.entry.size:
                what = "truncated" if size < f.entry.size else "longer than recorded"
                if f.index in ctx.embedded_since:
                    what += "; without the manifest `ckptspec embed` added to it, it is still not the recorded file"
                yield finding(
                    "CK208",
                    f.at("size"),
                    f"file is {size} bytes, the manifest records {f.entry.size} ({what})",
                    "the file was cut off or replaced after the manifest was written; restore it",
                    file=f.name,
                    rank=f.rank,
                )


@check("CK227")
def manifest_predates_embed(ctx: Context) -> Iterator[Finding]:
    """A model-states file ``ckptspec embed`` rewrote after the manifest was written, and otherwise
    the very file it records (rebuilt without the embedded manifest: the recorded size, and hash)."""
    for index, earlier in sorted(ctx.before_embed.items()):
        f = ctx.files[index]
        assert f.path is not None  # before_embed holds files read in the tag directory
        proof = f"{f.entry.hash.algorithm}" if f.entry.hash is not None and ctx.verify_hashes else "size"
        times = "" if earlier.embeds == 1 else f" {earlier.embeds} times"
        yield finding(
            "CK227",
            f.at("size"),
            f"the manifest predates `ckptspec embed`, which added a manifest to this file{times} (now "
            f"{f.path.stat().st_size} bytes, recorded {f.entry.size}): without it, it is the recorded file "
            f"(same {proof})",
            "the manifest is stale, not the file: use the checkpoint's own "
            "(`ckptspec extract CHECKPOINT -o manifest.json`) or generate it again",
            file=f.name,
            rank=f.rank,
        )


@check("CK209")
def shard_hash(ctx: Context) -> Iterator[Finding]:
    hashed = ctx.hashed_files()
    if isinstance(ctx.tag_dir, RemotePath):  # with the tensor digests, from one read of the bytes
        read = ctx.read_once()[0]
        digests = {id(f): read[f.name] for f in hashed}
    else:  # all files at once (threads: hashlib releases the GIL), one algorithm at a time
        digests = {}
        for algorithm in sorted({f.entry.hash.algorithm for f in hashed}):
            same = [f for f in hashed if f.entry.hash.algorithm == algorithm]
            digests.update(zip(map(id, same), (h.digest for h in file_digests([f.path for f in same], algorithm))))
    for f in hashed:
        actual = digests[id(f)]
        if actual != f.entry.hash.digest:
            yield finding(
                "CK209",
                f.at("hash"),
                f"{f.entry.hash.algorithm} of the file is {actual[:16]}..., the manifest records "
                f"{f.entry.hash.digest[:16]}...",
                "the content changed after the manifest was written (swapped rank files, a re-save, bit rot); "
                "restore it",
                file=f.name,
                rank=f.rank,
            )


OTHER_SAVE_HINT = (
    "every file differs from its record, and each reads as a DeepSpeed file: the manifest is likely of another "
    "save (a stale or copied sidecar, the tag saved again without ckptspec). If these files are the save you "
    "want, record them again (`ckptspec embed CHECKPOINT --rehash`, or generate the manifest again); if not, "
    "restore the files the manifest records"
)


def whole_save_differs(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """``findings`` with the hint of CK208/CK209 changed when every shard file differs from its record
    and none is damaged: not a file to restore but, most likely, a manifest of another save."""
    shards = {f.name for f in ctx.files if f.on_disk and f.role in ("model_states", "optimizer_states")}
    differ = {f.file for f in findings if f.code in ("CK208", "CK209", "CK227")}
    damaged = {f.file for f in findings if f.code in ("CK202", "CK204", "CK205", "CK225")}
    if len(shards) < 2 or differ != shards or damaged:
        return findings
    return [replace(f, hint=OTHER_SAVE_HINT) if f.code in ("CK208", "CK209") else f for f in findings]


def _unreadable(ctx: Context, code: str) -> Iterator[Finding]:
    for f in ctx.files:
        if f.loaded is not None and f.loaded.error is not None and code_and_hint(f.loaded.error)[0] == code:
            yield finding(
                code, f.at(), f.loaded.error.reason, code_and_hint(f.loaded.error)[1], file=f.name, rank=f.rank
            )


@check("CK202")
def legacy_serialization(ctx: Context) -> Iterator[Finding]:
    """A file in torch's legacy (non-zip) serialization: readable by torch, not describable."""
    yield from _unreadable(ctx, "CK202")


@check("CK204")
def unsafe_pickle(ctx: Context) -> Iterator[Finding]:
    yield from _unreadable(ctx, "CK204")


@check("CK205")
def damaged_file(ctx: Context) -> Iterator[Finding]:
    yield from _unreadable(ctx, "CK205")


def _archive_name(state: Any) -> str | None:
    for _, ref in iter_tensor_refs(state):
        return ref.storage.member.split("/", 1)[0]
    return None


def saved_as(name: str, state: Any) -> str | None:
    """The DeepSpeed file name ``torch.save`` recorded inside ``state``'s zip when it is not ``name``'s, else None."""
    archive = _archive_name(state)
    base = Path(name).name
    if archive is None or archive == base.removesuffix(".pt"):
        return None
    return archive + ".pt" if OPTIM_RE.match(archive + ".pt") or MODEL_RE.match(archive + ".pt") else None


SAVED_AS_HINT = "rank files were swapped or renamed; put each file back under the name it was saved as"


@check("CK210")
def shard_identity(ctx: Context) -> Iterator[Finding]:
    """torch.save records the file name inside the zip: a DeepSpeed shard saved as another rank's file was moved."""
    for f in ctx.files:
        if f.state is None:
            continue
        saved = saved_as(f.name, f.state)
        if saved is not None:
            yield finding(
                "CK210",
                f.at("path"),
                f"the file was saved as {saved} (the name recorded inside it), not as {Path(f.name).name}",
                SAVED_AS_HINT,
                file=f.name,
                rank=f.rank,
            )

"""Validate a DeepSpeed checkpoint directory: choose its manifest, validate it once, check the files.

``choose_manifest`` is the one answer to "which manifest describes this directory", used by
``validate DIR``, ``validate M --checkpoint DIR``, ``reconstruct`` and ``inspect DIR``:
the manifest given, else the tag directory's sidecar, else one generated from DeepSpeed's
own metadata, tolerant of files that cannot be read (they become findings). A manifest
of the layout only gets its files from the directory.

Every file is read once: the ``StateCache`` that chose the manifest is the one the checks,
the embedded-copy check and a following reconstruction read.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ...checkpoint.embedded import EmbeddedCopy, unreadable_sidecar
from ...checkpoint.sidecar import find_sidecar
from ...checkpoint.states import Loaded, StateCache, code_and_hint
from ...errors import CkptspecError, UnsupportedCheckpoint
from ...findings import Finding, finding, has_errors
from ...format.documents import read_and_validate, validate_file
from ...format.models import Manifest, ShardFile
from ...format.validate import Report, validate_manifest
from ...location import RemotePath, relative_name
from ..describe.zero import manifest_from_states
from ..layout.names import file_order, rank_of, role_of
from ..layout.tag_dir import ShardSet, index_kind_hint, resolve_tag_dir, scan_tag_dir
from .copies import embedded_findings
from .domain import check_checkpoint

if TYPE_CHECKING:
    from ...format.dcp_validate import DcpReport
    from ...format.index_validate import IndexReport


@dataclass
class Chosen:
    """The manifest that describes a tag directory, and how it was had."""

    tag_dir: Path | RemotePath
    source: Literal["manifest", "sidecar", "generated"]
    manifest: Manifest | None  # None when none could be had
    findings: list[Finding]  # validating it; when it has errors, they are why nothing else can run
    unreadable: list[Finding] = field(default_factory=list)  # CK204/CK205 of files the generation could not read
    sidecar: Path | RemotePath | None = None
    states: StateCache = field(default_factory=StateCache)
    sidecar_copy: EmbeddedCopy | None = None  # the sidecar as read, for the embedded-copy check

    @property
    def checkable(self) -> bool:
        """The files can be checked against the manifest: one given or found must be valid; a
        generated one is checked even when its rules fail (the checks then say which file is wrong)."""
        return self.manifest is not None and (self.source == "generated" or not has_errors(self.findings))


def choose_manifest(
    tag_dir: Path | RemotePath, manifest: Manifest | Report | None = None, *, states: StateCache | None = None
) -> Chosen:
    """Which manifest describes ``tag_dir``, validated exactly once.

    ``manifest``: a ``Manifest`` (validated here) or the ``Report`` of one the caller
    validated (not validated again). Without it: the sidecar, else a generated manifest
    (its rules run without the file list, which the checks cover better).
    """
    states = states if states is not None else StateCache()
    if isinstance(manifest, Report):
        chosen = Chosen(tag_dir, "manifest", manifest.manifest, list(manifest.findings), states=states)
    elif manifest is not None:
        chosen = Chosen(tag_dir, "manifest", manifest, validate_manifest(manifest).findings, states=states)
    elif (sidecar := find_sidecar(tag_dir)) is not None:
        try:
            document, report = read_and_validate(sidecar)
        except CkptspecError as exc:
            if exc.code != "CK903":
                raise
            # Bytes that are not a manifest (empty, truncated): a damaged part of the checkpoint,
            # CK302. The files are still checked, against a generated manifest, so that one run
            # also tells whether the shards are intact (`ckptspec embed` can then rewrite it).
            chosen = _generated(tag_dir, states)
            error = unreadable_sidecar(exc)
            chosen.findings = [finding(error.code, "$", error.message, error.hint, file=sidecar.name), *chosen.findings]
            return chosen
        if not isinstance(report, Report):  # the sidecar of a checkpoint an index describes
            raise UnsupportedCheckpoint(
                f"{sidecar.name} is a checkpoint index",
                index_kind_hint("tensor/pipeline-parallel, MoE and stage-0"),
                str(sidecar),
            )
        chosen = Chosen(tag_dir, "sidecar", report.manifest, list(report.findings), sidecar=sidecar, states=states)
        if isinstance(document, dict):  # compared with the embedded copies, without reading it again
            chosen.sidecar_copy = EmbeddedCopy(str(sidecar), "sidecar", document)
    else:
        return _generated(tag_dir, states)
    if chosen.checkable and chosen.manifest is not None and not chosen.manifest.files:
        # A manifest of the layout only (e.g. from the live engine): the files are the directory's.
        described, chosen.unreadable = describe_tolerantly(tag_dir, states)
        if described is None:
            chosen.findings = chosen.findings + chosen.unreadable
        else:
            chosen.manifest = chosen.manifest.model_copy(update={"files": described.files})
    return chosen


def _generated(tag_dir: Path | RemotePath, states: StateCache) -> Chosen:
    """The manifest generated from DeepSpeed's metadata (its rules run without the file list)."""
    generated, unreadable = describe_tolerantly(tag_dir, states)
    if generated is None:
        return Chosen(tag_dir, "generated", None, unreadable, unreadable, states=states)
    doc = generated.to_dict()
    doc["files"] = []
    findings = validate_manifest(generated, doc).findings
    return Chosen(tag_dir, "generated", generated, findings, unreadable, states=states)


def validate_checkpoint(
    checkpoint_dir: str | os.PathLike,
    manifest: Manifest | Report | str | os.PathLike | None = None,
    tag: str | None = None,
    *,
    verify_hashes: bool = True,
    states: StateCache | None = None,
    verify_digests: bool | None = None,
) -> tuple[Manifest | None, list[Finding]]:
    """Validate a DeepSpeed checkpoint directory: the whole flow.

    Resolves the tag (``tag``, else ``latest``, else the directory itself), takes
    ``manifest`` (a ``Manifest``, the ``Report`` of a validated one, or a manifest file),
    else the sidecar ``ckptspec.json``/``ckptspec.msgpack`` of the tag directory, else a
    manifest generated from DeepSpeed's metadata; validates the manifest (schema and
    rules) once and then checks the files against it. ``states``: where the decoded files
    are kept, for a reconstruction that follows. ``verify_digests`` (default: ``verify_hashes``)
    reads every located tensor to check its digest (CK222); a reader that checks them while
    streaming the tensors (``reconstruct``, ``load_state_dict``) passes False. Runs in this
    process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md).

    Returns (manifest, findings); the manifest is None when none could be had.
    Raises ``InvalidCheckpoint`` (exit 1) when the checkpoint cannot be checked at all
    (a bad ``latest``, no model states, an unsupported layout) and ``CkptspecError``
    (exit 2) when the directory or a manifest file cannot be read.
    """
    given: Manifest | Report | IndexReport | DcpReport | None = (
        validate_file(manifest) if isinstance(manifest, (str, os.PathLike)) else manifest  # an index: IndexReport
    )
    if not isinstance(given, (Manifest, Report)) and given is not None:  # a checkpoint index
        raise UnsupportedCheckpoint(
            "the manifest given is a checkpoint index or a DCP document; this function checks ZeRO data-parallel "
            "checkpoints "
            "against a manifest 1.x",
            "check it with validate_index.validate_index_checkpoint, or `ckptspec validate INDEX --checkpoint DIR`",
            str(checkpoint_dir),
        )
    if isinstance(given, Report) and (not given.ok or given.manifest is None):
        return given.manifest, list(given.findings)  # an invalid manifest is not checked against files
    chosen, findings = check_tag_dir(
        resolve_tag_dir(checkpoint_dir, tag), given, verify_hashes, states, verify_digests=verify_digests
    )
    return chosen.manifest, findings


def check_tag_dir(
    tag_dir: Path | RemotePath,
    manifest: Manifest | Report | None,
    verify_hashes: bool,
    states: StateCache | None = None,
    *,
    verify_digests: bool | None = None,
) -> tuple[Chosen, list[Finding]]:
    """``validate_checkpoint`` on a resolved tag directory, with the manifest choice itself."""
    chosen = choose_manifest(tag_dir, manifest, states=states)
    findings = chosen.findings
    if chosen.sidecar is not None:  # name the sidecar in its own findings
        findings = [f if f.file is not None else dataclasses.replace(f, file=chosen.sidecar.name) for f in findings]
    if not chosen.checkable:
        return chosen, findings
    assert chosen.manifest is not None  # checkable: a manifest was had
    findings = findings + check_checkpoint(
        chosen.manifest, tag_dir, verify_hashes=verify_hashes, states=chosen.states, verify_digests=verify_digests
    )
    # Copies embedded in the model states (client_state) must agree with each other and the sidecar;
    # their files are named like every other finding's, relative to the tag directory. An unreadable
    # sidecar the manifest choice already reported is not reported twice.
    read = [chosen.sidecar_copy] if chosen.sidecar_copy is not None else []
    for found in embedded_findings(tag_dir, states=chosen.states, read=read):
        relative = relative_name(found.file, tag_dir) if found.file is not None else None
        if relative is not None:
            found = dataclasses.replace(found, file=relative)
        if found not in findings:
            findings.append(found)
    return chosen, findings


def describe_tolerantly(tag_dir: Path | RemotePath, states: StateCache) -> tuple[Manifest | None, list[Finding]]:
    """A manifest from DeepSpeed's own metadata, and the CK204/CK205 of files it could not read.

    Files that cannot be read are left out of the derivation but listed (without
    locators), so that the checks name them. File entries for ranks outside the world
    size are dropped, so that the checks report those files as unexpected.
    The manifest is None when none can be derived (then a CK212 may say why).
    """
    shards = scan_tag_dir(tag_dir)  # raises CK202 / CK203
    states.load_all([*shards.model_files.values(), *shards.optim_files.values()])
    readable = ShardSet(tag_dir, other_files=list(shards.other_files))
    unreadable: dict[str, Loaded] = {}
    for role, mapping, target in (
        ("model_states", shards.model_files, readable.model_files),
        ("optimizer_states", shards.optim_files, readable.optim_files),
    ):
        for rank, path in mapping.items():
            loaded = states.load(path, members=role == "optimizer_states")
            if loaded.error is None:
                target[rank] = path
            else:
                # type: ignore: path is one of tag_dir's files, of its kind (Path or RemotePath both)
                unreadable[path.relative_to(tag_dir).as_posix()] = loaded  # type: ignore[arg-type]
    read_findings = [_read_finding(rel, loaded) for rel, loaded in unreadable.items()]
    if unreadable and (not readable.model_files or (shards.optim_files and not readable.optim_files)):
        return None, read_findings
    try:
        manifest = manifest_from_states(readable, states)
    except CkptspecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:
        first = readable.model_files[min(readable.model_files)]
        rel = first.relative_to(tag_dir).as_posix()  # type: ignore[arg-type]  # tag_dir's file, of its kind
        return None, read_findings + [
            finding(
                "CK212",
                "$",
                f"cannot derive the layout from DeepSpeed's metadata ({type(exc).__name__}: {str(exc)[:200]})",
                "the model or optimizer states are corrupt; restore the files of one save",
                file=rel,
                rank=rank_of(rel),
            )
        ]
    ws, stage = manifest.layout.world_size, manifest.layout.zero_stage
    kept = []
    for entry in manifest.files:
        if entry.role == "optimizer_states" and entry.ranks[0] >= ws:
            continue
        if entry.role == "model_states" and (
            entry.ranks[0] >= (ws if stage == 3 else 1)
            or (stage == 3) != Path(entry.path).name.startswith("zero_pp_rank_")
        ):
            continue
        kept.append(entry)
    for rel in unreadable:
        role, ranks = role_of(rel)
        if ranks and ranks[0] < ws:
            kept.append(ShardFile(path=rel, role=role, ranks=ranks, size=(tag_dir / rel).stat().st_size, partitions=[]))
    manifest.files = sorted(kept, key=lambda e: file_order(e.role, e.ranks, e.path))
    return manifest, read_findings


def _read_finding(rel: str, loaded: Loaded) -> Finding:
    assert loaded.error is not None  # a file that could not be read
    code, hint = code_and_hint(loaded.error)
    return finding(code, "$", loaded.error.reason, hint, file=rel, rank=rank_of(rel))


__all__ = ["Chosen", "check_tag_dir", "choose_manifest", "describe_tolerantly", "validate_checkpoint"]

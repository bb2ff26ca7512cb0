"""``ckptspec inspect`` and ``ckptspec diff``: read a manifest or checkpoint, summarize or compare.

A target is a manifest file (JSON or msgpack) or a DeepSpeed checkpoint directory; a
directory's manifest is the one ``validate DIR`` chooses (``choose_manifest``): the tag
directory's sidecar (``ckptspec.json``/``.msgpack``) if there is one, else one generated
from DeepSpeed's own metadata (no pickled code runs). Either way it is validated first, and a
directory's files are checked against it as ``validate DIR --no-hash`` checks them: a
checkpoint with an error finding is reported like ``validate`` reports it (exit 1) and not
summarized, so a summary never describes files that do not hold what it says.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import click

from ..errors import CkptspecError
from ..findings import Finding, has_errors
from ..format.codec import DEFAULT_MAX_BYTES
from ._common import (
    EXIT_INVALID,
    EXIT_OK,
    FORMAT_CHOICE,
    echo_findings,
    echo_json,
    error_dict,
    error_line,
    json_error_with,
    tag_needs_a_directory,
)

if TYPE_CHECKING:  # the models load pydantic; `ckptspec validate` must not pay for it
    from typing_extensions import TypeIs

    from ..format.index_models import CheckpointIndex
    from ..format.models import Manifest
    from ..report.diff import Diff


@dataclass
class Target:
    """A manifest read for inspect or diff, or the findings that stop it."""

    name: str  # as given on the command line
    source: str  # manifest | sidecar | generated
    manifest: Manifest | CheckpointIndex | None  # a checkpoint index for a tensor/pipeline-parallel one
    findings: list[Finding]
    where: str | None = None  # the sidecar file, when the manifest comes from one


def load_target(name: str, tag: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, option: str = "--tag") -> Target:
    """Read and validate the manifest of ``name`` (a file, or a checkpoint directory).

    A directory's manifest is the one ``validate DIR`` would check the files against
    (``choose_manifest``), and the files are checked against it (hashes aside).
    """
    from ..errors import UnsupportedCheckpoint
    from ..format.dcp_validate import DcpReport
    from ..format.documents import validate_file
    from ..location import is_directory

    if not is_directory(name):
        if tag is not None:
            raise tag_needs_a_directory(name, option)
        report = validate_file(name, max_bytes)  # a manifest or a checkpoint index
        if isinstance(report, DcpReport):
            raise UnsupportedCheckpoint(
                f"{name} is a torch DCP document (ckptspec.dcp): inspect and diff read a DCP checkpoint itself",
                "inspect or diff the DCP directory (.metadata); `validate DOC --checkpoint DCP_DIR` checks it",
                name,
            )
        return Target(name, "manifest", report.manifest if report.ok else None, report.findings)

    from ..deepspeed.check.zero import check_tag_dir
    from ..deepspeed.kinds import described_by_index
    from ..deepspeed.layout.tag_dir import resolve_tag_dir

    if described_by_index(name, None, tag):  # tensor/pipeline parallel, MoE, stage 0, universal: its index
        from ..deepspeed.check.checkpoint_index import validate_index_checkpoint

        index, findings = validate_index_checkpoint(name, None, tag, verify_hashes=False)
        return Target(name, "generated", index if not has_errors(findings) else None, findings)

    chosen, findings = check_tag_dir(resolve_tag_dir(name, tag), None, verify_hashes=False)
    manifest = chosen.manifest if not has_errors(findings) else None
    where = str(chosen.sidecar) if chosen.sidecar is not None else None
    return Target(name, chosen.source, manifest, findings, where)


def _source_dict(target: Target) -> dict:
    out = {"target": target.name, "source": target.source}
    if target.where is not None:
        out["manifest"] = target.where
    return out


def _label(target: Target) -> str:
    return {
        "manifest": target.name,
        "sidecar": f"{target.name} (sidecar {os.path.basename(target.where or '')})",
        "generated": f"{target.name} (manifest generated from DeepSpeed's metadata)",
    }[target.source]


def _show_findings(target: Target, findings: list[Finding], err: bool) -> None:
    # As `validate` prints them: after the target as given; a sidecar's findings name it.
    echo_findings(findings, target.name, err=err)


def _tty() -> bool:
    return sys.stdout.isatty()


def _fail(exc: CkptspecError, name: str, output_format: str, extra: dict, error: dict | None = None) -> NoReturn:
    """An input that cannot be read: the error line, or the JSON object with ``extra`` and an
    ``error`` naming the file the text line names (``error`` adds keys to it)."""
    if output_format == "json":
        _echo_error_json(exc, extra, error)
    else:
        click.echo(error_line(exc, name), err=True)
    sys.exit(exc.exit_code)


def _echo_error_json(exc: CkptspecError, extra: dict, error: dict | None = None) -> None:
    detail = {**error_dict(exc), **({"file": exc.file} if exc.file else {}), **(error or {})}
    echo_json({**extra, "valid": False, "findings": [], "error": detail})


def _json_errors(output_format: str, extra: dict) -> None:
    """An error no handler here catches (an internal one, CK999) is still the one JSON object."""
    if output_format == "json":
        json_error_with(lambda exc: _echo_error_json(exc, extra))


def _invalid(target: Target, output_format: str, extra: dict | None = None) -> NoReturn:
    """An input that is not a valid manifest: its findings, exit 1."""
    if output_format == "json":
        doc = {
            **(extra or {}),
            **_source_dict(target),
            "valid": False,
            "findings": [f.to_dict() for f in target.findings],
        }
        echo_json(doc)
    else:
        _show_findings(target, target.findings, err=False)
    sys.exit(EXIT_INVALID)


@click.command()
@click.argument("target", metavar="MANIFEST|CHECKPOINT")
@click.option(
    "--tag", default=None, help="With a checkpoint directory: the tag directory (default: the one named by 'latest')."
)
@click.option(
    "--format",
    "output_format",
    type=FORMAT_CHOICE,
    default="text",
    show_default=True,
    help="Text: rich tables. JSON: one summary object (docs/cli.md).",
)
@click.option(
    "--top", type=click.IntRange(min=0), default=10, show_default=True, help="How many of the largest tensors to list."
)
def inspect(target: str, tag: str | None, output_format: str, top: int) -> None:
    """Summarize a manifest or checkpoint: layout, groups, largest tensors, ties, files.

    A checkpoint directory is read like `validate DIR` reads it (its sidecar manifest,
    else one generated from DeepSpeed's metadata) and its files are checked as
    `validate DIR --no-hash` checks them: one with an error finding is not summarized.
    """
    from ..checkpoint.dcp.metadata import is_dcp
    from ..report.summary import summarize

    _json_errors(output_format, {"target": target})
    try:
        dcp = tag is None and is_dcp(target)  # a torch DCP checkpoint, local or at a URL
    except CkptspecError as exc:
        _fail(exc, target, output_format, {"target": target})
    if dcp:  # a torch DCP checkpoint: summarized from its .metadata
        from .inspect_dcp import inspect_dcp

        inspect_dcp(target, output_format, top)
    try:
        loaded = load_target(target, tag)
    except CkptspecError as exc:
        _fail(exc, target, output_format, {"target": target})
    if loaded.manifest is None or has_errors(loaded.findings):
        _invalid(loaded, output_format)
    if _is_index(loaded.manifest):
        _inspect_index(loaded, output_format)
        return
    summary = summarize(loaded.manifest, top=top)
    if output_format == "json":
        doc = {**_source_dict(loaded), "valid": True, "findings": [f.to_dict() for f in loaded.findings], **summary}
        echo_json(doc)
        return
    _show_findings(loaded, loaded.findings, err=True)  # warnings such as CK004
    from .render import render_summary

    click.echo(render_summary(_label(loaded), summary, color=_tty()), nl=False)


@click.command()
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--tag-a", default=None, help="With a checkpoint directory A: its tag directory (default: 'latest').")
@click.option("--tag-b", default=None, help="With a checkpoint directory B: its tag directory (default: 'latest').")
@click.option(
    "--format",
    "output_format",
    type=FORMAT_CHOICE,
    default="text",
    show_default=True,
    help="Text: a table of changes and the verdict. JSON: one object (docs/cli.md).",
)
def diff(a: str, b: str, tag_a: str | None, tag_b: str | None, output_format: str) -> None:
    """What changed from A to B, and can a job laid out like B resume from checkpoint A.

    \b
    A and B are manifests or checkpoint directories, or two torch DCP directories (the entries and values
    that changed; no resume verdict). Exit codes:
      0  B can resume from A's optimizer state (changes may still be listed)
      1  it cannot: every reason is printed with its code (CK501-CK510);
         or A or B is not a valid manifest
      2  usage or I/O error
    """
    from ..checkpoint.dcp.metadata import is_dcp
    from ..report.diff import diff_manifests

    _json_errors(output_format, {"a": {"target": a}, "b": {"target": b}})
    dcp = []
    for name in (a, b):
        try:
            dcp.append(is_dcp(name))  # a torch DCP checkpoint, local or at a URL
        except CkptspecError as exc:
            _fail(exc, name, output_format, {"a": {"target": a}, "b": {"target": b}}, {"target": name})
    if any(dcp):  # torch DCP directories: their entries and values compared
        from .diff_dcp import diff_dcp_dirs

        diff_dcp_dirs(a, b, dcp, [tag_a, tag_b], output_format)
    targets = []
    for name, tag, option in ((a, tag_a, "--tag-a"), (b, tag_b, "--tag-b")):
        try:
            targets.append(load_target(name, tag, option=option))
        except CkptspecError as exc:
            # `a` and `b` keep their shape (an input not read has no `source` yet); the error
            # names the input it is about, as each finding of an invalid input does.
            sides = [_source_dict(t) for t in targets] + [{"target": n} for n in (a, b)[len(targets) :]]
            _fail(exc, name, output_format, {"a": sides[0], "b": sides[1]}, {"target": name})
    bad = [t for t in targets if t.manifest is None or has_errors(t.findings)]
    if bad:
        if output_format == "json":
            doc = {
                "a": _source_dict(targets[0]),
                "b": _source_dict(targets[1]),
                "valid": False,
                "findings": [{**f.to_dict(), "target": t.name} for t in bad for f in t.findings],
            }
            echo_json(doc)
        else:
            for t in bad:
                _show_findings(t, t.findings, err=False)
        sys.exit(EXIT_INVALID)
    ta, tb = targets
    assert ta.manifest is not None and tb.manifest is not None  # the bad ones exited above
    result: Diff
    if _is_index(ta.manifest) or _is_index(tb.manifest):  # one at least is a checkpoint index
        from ..report.diff_kinds import diff_any

        result = diff_any(ta.manifest, tb.manifest)
    else:
        result = diff_manifests(ta.manifest, tb.manifest)
    if output_format == "json":
        echo_json({"a": _source_dict(ta), "b": _source_dict(tb), "valid": True, **result.to_dict()})
    else:
        for t in targets:
            _show_findings(t, t.findings, err=True)
        from .render import render_diff

        click.echo(render_diff(_label(ta), _label(tb), result.to_dict(), color=_tty()), nl=False)
        click.echo("")
        for reason in result.reasons:
            click.echo(f"B: {reason.to_line()}")
        click.echo(
            "resume: B can resume from A's optimizer state"
            if result.resumable
            else f"resume: B cannot resume from A ({len(result.reasons)} "
            f"reason{'s' if len(result.reasons) != 1 else ''})"
        )
    sys.exit(EXIT_OK if result.resumable else EXIT_INVALID)


def _is_index(document) -> TypeIs[CheckpointIndex]:
    from ..format.index_models import CheckpointIndex

    return isinstance(document, CheckpointIndex)


def _inspect_index(loaded: Target, output_format: str) -> None:
    """The parallel layout of a tensor/pipeline-parallel checkpoint."""
    from ..report.index_summary import summarize_index

    assert _is_index(loaded.manifest)  # inspect's caller asked
    summary = summarize_index(loaded.manifest)
    if output_format == "json":
        echo_json(
            {**_source_dict(loaded), "valid": True, "findings": [f.to_dict() for f in loaded.findings], **summary}
        )
        return
    _show_findings(loaded, loaded.findings, err=True)
    deg = summary["degrees"]
    click.echo(
        f"{_label(loaded)}: checkpoint index {summary['format_version']} ({summary['kind']}), "
        f"pipeline {deg['pipeline']} x tensor "
        f"{deg['tensor']} x data {deg['data']} ({summary['degrees_source']})"
    )
    for d in summary["domains"]:
        optimizer = f" {d['optimizer']}" if d["optimizer"] else ""  # not recorded for located masters
        click.echo(
            f"  {d['id']}: ZeRO-{d['zero_stage']}{optimizer} over {d['size']} ranks, "
            f"{d['parameters']} parameters ({d['numel']} elements), {d['files']} files"
            + (f"; masters in {d['masters']}{_copies(d['replicas'])}" if "masters" in d else "")
        )
    placements = ", ".join(f"{n} {k}" for k, n in summary["placements"].items())
    click.echo(
        f"  whole model: {summary['parameters']} parameters ({summary['numel']} elements; {placements}), "
        f"{summary['layer_files']} layer files"
        + (f", {summary['expert_files']} expert files" if summary["expert_files"] else "")
    )


def _copies(replicas: int) -> str:
    """The masters' other saved copies (DeepSpeed saves some on every rank), when there are any."""
    return f" and {replicas} more saved cop{'y' if replicas == 1 else 'ies'}" if replicas else ""

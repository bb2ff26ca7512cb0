"""``ckptspec inspect DCP_DIR``: a torch DCP checkpoint summarized from its ``.metadata`` (issue #42).

The directory is checked first as ``validate DCP_DIR`` checks it (``checkpoint.dcp.checks``): one with an error
finding is reported like ``validate`` reports it (exit 1) and not summarized. The summary: the tensors by the first
part of their names (``model``, ``optim``), the largest tensors with their chunks, the bytes entries (pickled
objects, named: read by the restricted reader when checked) and the files with their items; for a Megatron-core
``torch_dist`` save, its backends (``metadata.json``) and its common state (``common.pt``, read by the restricted
reader: values, tensors by dtype and shape).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from ..errors import CkptspecError
from ..findings import has_errors
from ..format.dtypes import ITEMSIZE
from ..location import RemotePath, location
from ._common import EXIT_INVALID, EXIT_OK, echo_findings, echo_json, error_line, validation_report


def summarize_dcp(directory: Path | RemotePath, top: int) -> tuple[dict[str, Any], list]:
    """The summary of the checked DCP checkpoint in ``directory`` (None when it has errors), and the findings."""
    from ..checkpoint.dcp.checks import bytes_entries, check_dcp
    from ..checkpoint.dcp.megatron import describe
    from ..checkpoint.dcp.metadata import TensorEntry

    meta, findings = check_dcp(directory)
    tensors = {fqn: e for fqn, e in meta.entries.items() if isinstance(e, TensorEntry)}
    groups: dict[str, dict[str, int]] = {}
    for fqn, e in tensors.items():
        group = groups.setdefault(fqn.split(".", 1)[0], {"tensors": 0, "numel": 0, "nbytes": 0})
        numel = math.prod(e.size)
        group["tensors"] += 1
        group["numel"] += numel
        group["nbytes"] += numel * ITEMSIZE.get(e.dtype, 0)
    largest = sorted(tensors.items(), key=lambda kv: (-math.prod(kv[1].size), kv[0]))[:top]
    files = {name: {"items": 0, "bytes": 0} for name in meta.files}
    for item in meta.items:
        files[item.file]["items"] += 1
        files[item.file]["bytes"] = max(files[item.file]["bytes"], item.offset + item.length)
    summary = {
        "kind": "dcp" if meta.megatron is None else "megatron-torch_dist",
        "version": meta.version,
        "groups": groups,
        "largest": [
            {"name": fqn, "dtype": e.dtype, "shape": list(e.size), "chunks": len(e.chunks)} for fqn, e in largest
        ],
        "bytes_entries": bytes_entries(meta),
        "files": [{"name": name, **counts} for name, counts in files.items()],
    }
    if meta.megatron is not None:
        summary["megatron"] = {"config": meta.megatron.config, "common": describe(meta.megatron.common)}
    return summary, findings


def inspect_dcp(target: str, output_format: str, top: int) -> NoReturn:
    try:
        summary, findings = summarize_dcp(location(target), top)
    except CkptspecError as exc:
        if output_format == "json":
            echo_json(validation_report(target, [], exc))
        else:
            click.echo(error_line(exc, target), err=True)
        sys.exit(exc.exit_code)
    if has_errors(findings):
        if output_format == "json":
            echo_json(validation_report(target, findings))
        else:
            echo_findings(findings, target, err=True)
            click.echo(f"{target}: not summarized: the checkpoint has errors", err=True)
        sys.exit(EXIT_INVALID)
    if output_format == "json":
        echo_json({"target": target, "valid": True, "findings": [f.to_dict() for f in findings], **summary})
        sys.exit(EXIT_OK)
    what = "torch DCP" if "megatron" not in summary else "Megatron-core torch_dist"
    lines = [f"{target}: {what} checkpoint (metadata version {summary['version']}), {len(summary['files'])} files"]
    for name, g in summary["groups"].items():
        lines.append(f"  {name}: {g['tensors']} tensors, {g['numel']:,} elements, {g['nbytes'] / 2**20:.1f} MiB")
    if summary["largest"]:
        lines.append("  largest tensors:")
        for t in summary["largest"]:
            lines.append(f"    {t['name']}  {t['dtype']}  {t['shape']}  {t['chunks']} chunks")
    listed = summary["bytes_entries"]
    if listed:
        lines.append(f"  bytes entries (pickles, read by the restricted reader): {len(listed)}: {', '.join(listed)}")
    if "megatron" in summary:
        common = summary["megatron"]["common"]
        shown = ", ".join(f"{k}={v!r:.60}" for k, v in common.items()) if isinstance(common, dict) else "missing"
        lines.append(f"  common.pt (read by the restricted reader): {shown}")
    lines.append("  files:")
    for f in summary["files"]:
        lines.append(f"    {f['name']}  {f['items']} items  {f['bytes']:,} bytes")
    click.echo("\n".join(lines))
    sys.exit(EXIT_OK)

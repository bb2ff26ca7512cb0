"""Text rendering of ``inspect`` summaries and ``diff`` results with rich tables.

rich is imported only here, and only when text output is asked for. Without a
terminal the output is plain (no colour, no terminal width): a fixed width, so
that transcripts in the docs and in scripts are stable.
"""

from __future__ import annotations

import io
from typing import Any

PLAIN_WIDTH = 100


def _console(color: bool, width: int | None):
    from rich.console import Console

    return Console(
        file=io.StringIO(),
        width=width or PLAIN_WIDTH,
        color_system="standard" if color else None,
        force_terminal=color,
        no_color=not color,
        markup=False,
        highlight=False,
        emoji=False,
        legacy_windows=False,
    )


def _text(console) -> str:
    """What was printed, without the spaces rich pads titles and headers with to the table's width."""
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())


def _table(title: str, *columns: str, right: tuple[str, ...] = (), no_wrap: tuple[str, ...] = ()):
    from rich.box import Box
    from rich.table import Table

    # rich's SIMPLE_HEAD drawn with '-': readable in any locale and encoding.
    ascii_head = Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)
    table = Table(
        title=title, title_justify="left", box=ascii_head, show_edge=False, pad_edge=False, title_style="bold"
    )
    for column in columns:
        table.add_column(
            column, justify="right" if column in right else "left", overflow="fold", no_wrap=column in no_wrap
        )
    return table


def _shape(shape: list[int] | None) -> str:
    return "?" if shape is None else "(" + ", ".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


def _n(value: int) -> str:
    return f"{value:,}"


def _cells(*values: Any):
    from rich.text import Text

    return [Text(str(v)) for v in values]  # Text: names are never read as markup


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith("s") else "s")


def render_summary(target: str, summary: dict[str, Any], *, color: bool = False, width: int | None = None) -> str:
    console = _console(color, width)
    lay, tot, prod = summary["layout"], summary["totals"], summary["producer"]
    flags = [f for f in ("round_robin", "parameter_alignment") if lay[f]]
    if lay["sub_group_size"] is not None:
        flags.append(f"sub_group_size={lay['sub_group_size']}")
    if lay["exclude_frozen_parameters"]:
        flags.append("exclude_frozen_parameters")
    lines = [
        target,
        f"  format {summary['format_version']}, produced by {prod['tool']} from {prod['framework']} "
        f"{prod['framework_version']}",
        f"  ZeRO stage {lay['zero_stage']}, world size {lay['world_size']}, {lay['model_dtype']} model, "
        f"{lay['master_dtype']} masters"
        + (f", {lay['optimizer']}" if lay["optimizer"] else "")
        + (f" ({', '.join(flags)})" if flags else ""),
        f"  {tot['trainable']} trainable ({_n(tot['trainable_numel'])} elements, {_n(tot['padded_numel'])} with "
        "padding), "
        f"{tot['frozen']} frozen ({_n(tot['frozen_numel'])}), {_plural(tot['aliases'], 'alias')}, "
        f"{tot['buffers']} buffer{'s' if tot['buffers'] != 1 else ''} ({_n(tot['buffer_numel'])}), "
        f"{tot['excluded']} excluded",
        f"  {_plural(tot['files'], 'file')}, {_n(tot['file_bytes'])} bytes",
    ]
    for line in lines:
        console.print(line, soft_wrap=True)

    groups = _table(
        "Groups",
        "group",
        "optimizer group",
        "partitioning",
        "params",
        "elements",
        "padded",
        "ranks",
        "per rank",
        right=("group", "optimizer group", "params", "elements", "padded", "ranks", "per rank"),
    )
    for g in summary["groups"]:
        groups.add_row(
            *_cells(
                g["index"],
                g["optimizer_group"],
                g["partitioning"],
                g["params"],
                _n(g["numel"]),
                _n(g["padded_numel"]),
                g["partition_count"],
                _n(g["partition_numel"]),
            )
        )
    tables = [groups]

    largest = _table(
        f"Largest tensors (top {len(summary['largest'])})",
        "name",
        "role",
        "shape",
        "dtype",
        "elements",
        "group",
        right=("elements", "group"),
    )
    for t in summary["largest"]:
        largest.add_row(
            *_cells(t["name"], t["role"], _shape(t["shape"]), t["dtype"], _n(t["numel"]), t.get("group", ""))
        )
    tables.append(largest)
    if summary["aliases"]:
        aliases = _table("Aliases (tied parameters)", "name", "owner", "shape")
        for a in summary["aliases"]:
            aliases.add_row(*_cells(a["name"], a["owner"], _shape(a["shape"])))
        tables.append(aliases)
    if summary["frozen"]:
        frozen = _table("Frozen parameters", "name", "shape", "dtype", "elements", "stored in", right=("elements",))
        for f in summary["frozen"]:
            frozen.add_row(*_cells(f["name"], _shape(f["shape"]), f["dtype"], _n(f["numel"]), f["stored_in"]))
        tables.append(frozen)
    if summary["buffers"]:
        buffers = _table("Buffers", "name", "shape", "dtype", "elements", right=("elements",))
        for b in summary["buffers"]:
            buffers.add_row(*_cells(b["name"], _shape(b["shape"]), b["dtype"], _n(b["numel"])))
        tables.append(buffers)
    if summary["excluded"]:
        excluded = _table("Excluded (not saved)", "name", "reason")
        for e in summary["excluded"]:
            excluded.add_row(*_cells(e["name"], e["reason"]))
        tables.append(excluded)
    if summary["files"]:
        files = _table("Files", "path", "role", "ranks", "bytes", "hash", right=("bytes",))
        for f in summary["files"]:
            files.add_row(
                *_cells(f["path"], f["role"], ",".join(map(str, f["ranks"])), _n(f["size"]), f["hash"] or "-")
            )
        tables.append(files)
    ranks = _table(
        "Ranks", "rank", "master elements", "files", "bytes", right=("rank", "master elements", "files", "bytes")
    )
    for r in summary["ranks"]:
        ranks.add_row(*_cells(r["rank"], _n(r["master_numel"]), r["files"], _n(r["bytes"])))
    tables.append(ranks)
    for table in tables:
        console.print()
        console.print(table)
    return _text(console)


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return _shape(value)
    if isinstance(value, dict) and "name" in value:  # a param's place in a group
        return f"{value['name']} {_shape(value['shape'])} at {value['offset']}" + (
            f" +{value['padding']}" if value["padding"] else ""
        )
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_diff(
    label_a: str, label_b: str, result: dict[str, Any], *, color: bool = False, width: int | None = None
) -> str:
    console = _console(color, width)
    console.print(f"A: {label_a}", soft_wrap=True)
    console.print(f"B: {label_b}", soft_wrap=True)
    if result["identical"]:
        console.print("no changes", soft_wrap=True)
    else:
        changes = _table(
            f"{len(result['changes'])} change{'s' if len(result['changes']) != 1 else ''}",
            "change",
            "what",
            "A",
            "B",
            no_wrap=("change", "what"),
        )
        for c in result["changes"]:
            # A field of a domain's layout (an index has one per domain) is named by its whole path.
            in_domain = c["kind"] == "layout" and c["path"].startswith("$.domains[")
            what = c["path"] if c["kind"] == "group" or in_domain else c.get("name") or c["path"]
            if c.get("role") and c["kind"] not in ("layout", "group"):
                what = f"{c['role']} {what}"
            changes.add_row(*_cells(c["kind"], what, _value(c["a"]), _value(c["b"])))
        console.print()
        console.print(changes)
    return _text(console)


__all__ = ["render_summary", "render_diff", "PLAIN_WIDTH"]

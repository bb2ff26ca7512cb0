"""CK7xx: the rules of a torch DCP document that its JSON Schema cannot say (no files read).

One rule = one function = one code, as in ``rules/``. The rules read the plain decoded document and assume it
passed the schema. ``docs/errors.md`` documents each code; ``tests/conformance/dcp-1.0`` has a fixture for each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from ..findings import Finding, RuleSet, finding, json_path
from .dtypes import ITEMSIZE

DcpRule = Callable[[dict[str, Any]], Iterator[Finding]]
DCP_RULES: RuleSet[DcpRule] = RuleSet()
rule = DCP_RULES.register

# FileSystemWriter's file names: __<rank>_<n>.distcp
RANK_FILE = re.compile(r"__(0|[1-9][0-9]*)_(0|[1-9][0-9]*)\.distcp\Z")


def check_dcp_rules(doc: dict[str, Any]) -> list[Finding]:
    return [found for r in DCP_RULES for found in r.check(doc)]


def _inside(chunk: dict, shape: list[int]) -> bool:
    return len(chunk["offsets"]) == len(chunk["sizes"]) == len(shape) and all(
        o + s <= w for o, s, w in zip(chunk["offsets"], chunk["sizes"], shape)
    )


def _overlap(a: dict, b: dict) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a["offsets"], a["sizes"], b["offsets"], b["sizes"])
    )


@rule("CK701")
def chunk_coverage(doc: dict) -> Iterator[Finding]:
    """A tensor's chunks lie inside it (its rank of dimensions), do not overlap and hold all of its elements."""
    hint = "a tensor's chunks cover it exactly once, as the .metadata of the save says"
    for t, tensor in enumerate(doc["tensors"]):
        shape = tensor["shape"]
        good = []
        for c, chunk in enumerate(tensor["chunks"]):
            if _inside(chunk, shape):
                good.append(chunk)
                continue
            where = json_path("tensors", t, "chunks", c)
            yield finding(
                "CK701", where, f"chunk at {chunk['offsets']} of sizes {chunk['sizes']} lies outside {shape}", hint
            )
        if len(good) != len(tensor["chunks"]):
            continue
        nonempty = sorted((c for c in good if math.prod(c["sizes"])), key=lambda c: c["offsets"])
        overlapping = [
            (a, b)
            for i, a in enumerate(nonempty)
            for b in nonempty[i + 1 :]
            if not a["offsets"] or b["offsets"][0] < a["offsets"][0] + a["sizes"][0]
            if _overlap(a, b)
        ]
        for a, b in overlapping[:4]:
            where = json_path("tensors", t, "chunks")
            yield finding("CK701", where, f"chunks at {a['offsets']} and {b['offsets']} overlap", hint)
        held, whole = sum(math.prod(c["sizes"]) for c in good), math.prod(shape)
        if not overlapping and held != whole:
            where = json_path("tensors", t, "chunks")
            yield finding("CK701", where, f"the chunks hold {held} of the tensor's {whole} elements (a gap)", hint)


@rule("CK702")
def names(doc: dict) -> Iterator[Finding]:
    """Every tensor and bytes item has a name of its own; every file is listed once, by a plain file name."""
    seen: set[str] = set()
    for kind in ("tensors", "bytes"):
        for i, entry in enumerate(doc[kind]):
            if entry["name"] in seen:
                yield finding(
                    "CK702",
                    json_path(kind, i, "name"),
                    f"{entry['name']!r} names another entry too",
                    "a state dict key names one entry",
                )
            seen.add(entry["name"])
    paths: set[str] = set()
    for i, f in enumerate(doc["files"]):
        path = f["path"]
        if "/" in path or "\\" in path or path in (".", "..", ".metadata"):
            yield finding(
                "CK702",
                json_path("files", i, "path"),
                f"{path!r} is not a file name beside .metadata",
                "DCP writes its files in the checkpoint directory; no other path is read",
            )
        elif path in paths:
            yield finding("CK702", json_path("files", i, "path"), f"{path} is listed twice", "list each file once")
        paths.add(path)


def _items(doc: dict) -> Iterator[tuple[tuple, dict, int]]:
    """(JSON path parts, item, bytes of its elements or 0) of every chunk and bytes item."""
    for t, tensor in enumerate(doc["tensors"]):
        itemsize = ITEMSIZE[tensor["dtype"]]
        for c, chunk in enumerate(tensor["chunks"]):
            yield ("tensors", t, "chunks", c), chunk, math.prod(chunk["sizes"]) * itemsize
    for b, item in enumerate(doc["bytes"]):
        yield ("bytes", b), item, 0


@rule("CK703")
def item_place(doc: dict) -> Iterator[Finding]:
    """Every item is in a listed file and ends inside it (one finding per file cut short, at its first item past
    the end); a chunk's elements lie inside its item."""
    sizes = {f["path"]: f["size"] for f in doc["files"]}
    past: dict[str, list[tuple[tuple, int]]] = {}
    for parts, item, nbytes in _items(doc):
        size = sizes.get(item["file"])
        end = item["offset"] + item["length"]
        if size is None:
            yield finding(
                "CK703", json_path(*parts, "file"), f"{item['file']} is not in files", "list every file an item names"
            )
        elif end > size:
            past.setdefault(item["file"], []).append((parts, end))
        if "data_offset" in item and not item["offset"] <= item["data_offset"] <= end - nbytes:
            yield finding(
                "CK703",
                json_path(*parts, "data_offset"),
                f"the chunk's {nbytes} bytes at {item['data_offset']} are not inside its item "
                f"[{item['offset']}, {end})",
                "a chunk's elements are inside its torch.save record",
            )
    for name, items in past.items():
        parts, end = items[0]
        yield finding(
            "CK703",
            json_path(*parts, "length"),
            f"{len(items)} items end past the {sizes[name]} bytes of {name}, this one at byte {end}",
            "an item lies inside its file: the file's size or the items' places are not the save's",
        )


@rule("CK704")
def item_overlap(doc: dict) -> Iterator[Finding]:
    """No two items share a byte of their file (DCP writes each record once, one after the other)."""
    by_file: dict[str, list[tuple[int, int, tuple]]] = {}
    for parts, item, _ in _items(doc):
        if item["length"]:
            by_file.setdefault(item["file"], []).append((item["offset"], item["offset"] + item["length"], parts))
    for name, spans in by_file.items():
        spans.sort()
        reported = 0
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end and reported < 4:
                reported += 1
                yield finding(
                    "CK704",
                    json_path(*second, "offset"),
                    f"the item at byte {start} of {name} overlaps the one of {json_path(*first)} (ending at {end})",
                    "each item has bytes of its own",
                )


@rule("CK705")
def world_size(doc: dict) -> Iterator[Finding]:
    """A file named for a rank (``__<rank>_<n>.distcp``) names a rank of the saving world."""
    size = doc.get("world_size")
    if size is None:
        return
    for i, f in enumerate(doc["files"]):
        match = RANK_FILE.match(f["path"])
        if match and int(match.group(1)) >= size:
            yield finding(
                "CK705",
                json_path("files", i, "path"),
                f"{f['path']} was written by rank {match.group(1)}, outside world_size {size}",
                "world_size is the saving job's; its ranks are 0 .. world_size - 1",
            )

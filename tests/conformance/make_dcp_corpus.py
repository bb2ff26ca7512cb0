"""Generate the torch DCP document corpus, dcp-1.0/ (schema/dcp-1.0.schema.json, docs/spec-dcp.md).

    python tests/conformance/make_dcp_corpus.py          # (re)write dcp-1.0/
    python tests/conformance/make_dcp_corpus.py --check  # exit 1 if a committed file differs

Every document is one of dcp-sources/ (``ckptspec generate`` of the DCP saves of the harness's real FSDP2 jobs:
world size 2 with ``--hash``, world size 3 without) or one named edit of one. As in make_index_corpus.py (whose
helpers it uses), codes and error paths are stated by hand and nothing is imported from ckptspec. expected.json is
written too.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_index_corpus import Edit, _edits, _pop, _set, render, sync

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "dcp-sources"
CORPUS = HERE / "dcp-1.0"
WS2, WS3 = "fsdp2-ws2-hashed", "fsdp2-ws3"


def _newer_minor(doc):
    doc["format_version"] = "1.3.0"
    doc["future_field"] = {"x": 1}
    doc["tensors"][1]["chunks"][0]["future_note"] = "kept"


def _empty_tensor(doc):
    """A tensor without elements has no chunk to place: [0, 4] with none."""
    doc["tensors"].append({"name": "model.empty", "dtype": "bfloat16", "shape": [0, 4], "chunks": []})


def _move(path: str, delta: int) -> Edit:
    def edit(doc):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        at = doc
        for p in parents:
            at = at[p]
        at[last] += delta

    return edit


VALID: dict[str, tuple[str, Edit | None, str]] = {
    WS2: (WS2, None, "the document of a real FSDP2 save (world size 2, model and AdamW state), files, chunks hashed"),
    WS3: (WS3, None, "the document of a real FSDP2 save at world size 3, without hashes"),
    "no-world-size": (WS3, _pop("world_size"), "the saving world size unknown: absent"),
    "empty-tensor": (WS3, _empty_tensor, "a tensor of no element and no chunk"),
    "newer-minor-1.3.0-unknown-fields": (WS2, _newer_minor, "a newer minor: unknown fields tolerated, CK004"),
}

INVALID: list[tuple[str, str, Edit, list[str], list[str], str]] = [
    (
        "CK001-schema-chunk-without-data-offset",
        WS2,
        _pop("tensors/1/chunks/0/data_offset"),
        ["CK001"],
        ["$.tensors[1].chunks[0]"],
        "a chunk says where its elements start",
    ),
    (
        "CK001-schema-dtype-unknown",
        WS3,
        _set("tensors/1/dtype", "float4_e2m1"),
        ["CK001"],
        ["$.tensors[1].dtype"],
        "a dtype this format does not name is a new major, never a minor",
    ),
    (
        "CK001-schema-world-size-zero",
        WS3,
        _set("world_size", 0),
        ["CK001"],
        ["$.world_size"],
        "a world size is positive",
    ),
    (
        "CK001-schema-bytes-item-with-chunks",
        WS3,
        _set("bytes/0/chunks", []),
        ["CK001"],
        ["$.bytes[0]"],
        "a bytes item is a pickle's place, not a tensor",
    ),
    (
        "CK001-schema-chunk-digest-algorithm",
        WS2,
        _set("tensors/1/chunks/0/digest", {"md5": "00"}),
        ["CK001"],
        ["$.tensors[1].chunks[0].digest"],
        "a chunk's digest is a sha256",
    ),
    (
        "CK003-format-major-2",
        WS3,
        _set("format_version", "2.0.0"),
        ["CK003"],
        ["$.format_version"],
        "another major is refused before anything else is read",
    ),
    (
        "CK701-chunk-outside",
        WS3,
        _set("tensors/1/chunks/2/sizes", [17, 16]),
        ["CK701"],
        ["$.tensors[1].chunks[2]"],
        "the last chunk of emb.weight [50, 16] ends at row 51",
    ),
    (
        "CK701-chunk-overlap",
        WS3,
        _set("tensors/1/chunks/1/offsets", [16, 0]),
        ["CK701"],
        ["$.tensors[1].chunks"],
        "two chunks share row 16",
    ),
    (
        "CK701-chunk-gap",
        WS3,
        _pop("tensors/2/chunks/1"),
        ["CK701"],
        ["$.tensors[2].chunks"],
        "rows 11-21 of l1.weight are in no chunk",
    ),
    (
        "CK701-chunk-rank",
        WS3,
        _set("tensors/3/chunks/0/offsets", [0, 0]),
        ["CK701"],
        ["$.tensors[3].chunks[0]"],
        "a chunk of a 1-d tensor has one offset",
    ),
    (
        "CK702-duplicate-tensor-name",
        WS3,
        _set("tensors/2/name", "model.emb.weight"),
        ["CK702"],
        ["$.tensors[2].name"],
        "a state dict key names one entry",
    ),
    (
        "CK702-bytes-item-named-as-a-tensor",
        WS3,
        _set("bytes/0/name", "model.l1.bias"),
        ["CK702"],
        ["$.bytes[0].name"],
        "a tensor and a bytes item share a name",
    ),
    (
        "CK702-file-path-with-directory",
        WS3,
        _edits(
            _set("files/0/path", "../__0_0.distcp"),
            *[_set(f"tensors/{t}/chunks/0/file", "../__0_0.distcp") for t in range(19)],
        ),
        ["CK702"],
        ["$.files[0].path"],
        "a file is named beside .metadata, never by a path",
    ),
    (
        "CK703-item-file-not-listed",
        WS3,
        _set("tensors/1/chunks/0/file", "__7_0.distcp"),
        ["CK703"],
        ["$.tensors[1].chunks[0].file"],
        "a chunk names a file the document does not list",
    ),
    (
        "CK703-item-past-file-end",
        WS3,
        _set("files/2/size", 1000),
        ["CK703"],
        ["$.tensors[1].chunks[2].length"],
        "__2_0.distcp is too small for the items in it: one finding, at the first of them",
    ),
    (
        "CK703-data-offset-outside-item",
        WS3,
        _move("tensors/4/chunks/1/data_offset", 4096),
        ["CK703"],
        ["$.tensors[4].chunks[1].data_offset"],
        "a chunk's elements lie inside its record",
    ),
    (
        "CK704-items-overlap",
        WS3,
        _move("tensors/2/chunks/0/offset", -1),
        ["CK704"],
        ["$.tensors[2].chunks[0].offset"],
        "two records share a byte of __0_0.distcp",
    ),
    (
        "CK705-rank-outside-world-size",
        WS3,
        _set("world_size", 2),
        ["CK705"],
        ["$.files[2].path"],
        "__2_0.distcp was written by rank 2 of a world of 2",
    ),
]


def _source(name: str) -> dict:
    return json.loads((SOURCES / f"{name}.json").read_text("utf-8"))


def corpus() -> dict[Path, str]:
    """Path -> text of every file of the corpus, expected.json included."""
    out, expected, docs = {}, {}, {}
    for name, (base, edit, description) in VALID.items():
        doc = _source(base)
        if edit is not None:
            edit(doc)
        docs[name] = doc
        rel = f"valid/{name}.json"
        out[CORPUS / rel] = render(doc)
        expected[rel] = {
            "valid": True,
            "codes": [],
            "warnings": ["CK004"] if name.startswith("newer-minor") else [],
            "paths": [],
            "description": description if base == name else f"{description} (from {base})",
        }
    for name, base, edit, codes, paths, description in INVALID:
        doc = copy.deepcopy(docs[base])
        edit(doc)
        rel = f"invalid/{name}.json"
        out[CORPUS / rel] = render(doc)
        expected[rel] = {
            "valid": False,
            "codes": sorted(codes),
            "warnings": [],
            "paths": sorted(paths),
            "description": f"{description} (from valid/{base}.json)",
        }
    out[CORPUS / "expected.json"] = json.dumps(dict(sorted(expected.items())), indent=2, ensure_ascii=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    return sync(corpus(), CORPUS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())

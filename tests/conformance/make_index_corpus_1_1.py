"""Generate the checkpoint index 1.1 corpus, checkpoint-1.1/ (schema/checkpoint-1.1.schema.json).

    python tests/conformance/make_index_corpus_1_1.py          # (re)write checkpoint-1.1/
    python tests/conformance/make_index_corpus_1_1.py --check  # exit 1 if a committed file differs

Index 1.1 adds the frozen parameters, buffers and ties of the whole model (``extras``, ``aliases``, a
shard's ``locator``: docs/spec-checkpoint.md#extras). Every document is the 1.1 index of a real DeepSpeed
checkpoint (index-1.1/: ``ckptspec generate`` of the harness's AutoTP tp2 ZeRO-1 fp32 and pipeline pp2
ZeRO-1 fp32 checkpoints with a frozen weight, buffers and, in the pipeline, a ``TiedLayerSpec``), a 1.0
one bumped to 1.1 (what ``ckptspec migrate --to 1.1`` writes: extras not described), or one named edit
of one. As in make_index_corpus.py (whose helpers it uses), codes and error paths are stated by hand and
nothing is imported from ckptspec. expected.json is written too.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_index_corpus import Edit, _pop, _set, render, sync

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "index-1.1"
CORPUS = HERE / "checkpoint-1.1"
TP, PP = "tp2-s1-fp32-ws2-extras", "pp2-s1-fp32-ws2-extras"
BUMPED = "pp-1.0-bumped"


def _newer_minor(doc):
    doc["format_version"] = "1.4.0"
    doc["future_field"] = {"x": 1}
    doc["extras"][0]["future_note"] = "kept"


VALID: dict[str, tuple[str, Edit | None, str]] = {
    TP: (TP, None, "the 1.1 index of a real AutoTP tp2 checkpoint: a frozen split weight, a frozen bias, two buffers"),
    PP: (PP, None, "the 1.1 index of a real pipeline pp2 checkpoint: layer-file locators, a tie across stages"),
    BUMPED: (BUMPED, None, "a 1.0 index migrated up: a version bump, its extras not described (a reader derives them)"),
    "newer-minor-1.4.0-unknown-fields": (PP, _newer_minor, "a newer minor: unknown fields tolerated, CK004"),
}

INVALID: list[tuple[str, str, Edit, list[str], list[str], str]] = [
    (
        "CK001-schema-extra-role-trainable",
        TP,
        _set("extras/0/role", "trainable"),
        ["CK001"],
        ["$.extras[0].role"],
        "an extra is a frozen parameter or a buffer; trainable parameters are parameters[]",
    ),
    (
        "CK001-schema-parameter-role-frozen",
        TP,
        _set("parameters/0/role", "frozen"),
        ["CK001"],
        ["$.parameters[0].role"],
        "1.1 adds no role to parameters[] (a minor adds no enumeration value): frozen ones are extras[]",
    ),
    (
        "CK001-schema-extra-without-shards",
        TP,
        _set("extras/1/shards", []),
        ["CK001"],
        ["$.extras[1].shards"],
        "an extra has a shard",
    ),
    (
        "CK001-schema-locator-missing-numel",
        PP,
        _pop("extras/0/shards/0/locator/numel"),
        ["CK001"],
        ["$.extras[0].shards[0].locator"],
        "a locator states its numel",
    ),
    (
        "CK001-schema-alias-owner-number",
        PP,
        _set("aliases/4.weight", 0),
        ["CK001"],
        ["$.aliases['4.weight']"],
        "a tie's owner is a name",
    ),
    (
        "CK001-schema-extra-placement-source-none",
        TP,
        _set("extras/0/placement_source", "none"),
        ["CK001"],
        ["$.extras[0].placement_source"],
        "an extra is placed by the affine_map, a pipeline layer or the engine",
    ),
]


def invalid_semantic() -> list[tuple[str, str, Edit, list[str], list[str], str]]:
    """Schema-valid documents that the rules refuse (CK605 and CK610 on the extras)."""
    return [
        (
            "CK605-extra-split-overlap",
            TP,
            _set("extras/0/shards/1/placement/split/offset", 0),
            ["CK605"],
            ["$.extras[0].shards"],
            "tensor rank 1's block of the frozen blocks.0.up.weight placed over rank 0's",
        ),
        (
            "CK610-extra-no-such-buffer",
            TP,
            _set("extras/2/shards/0/local_name", "runnin"),
            ["CK610"],
            ["$.extras[2].shards[0]", "$.domains[0].manifest.buffers"],
            "a shard names a buffer its domain does not hold, and the domain's 'running' is no shard",
        ),
        (
            "CK610-extra-dropped",
            TP,
            _pop("extras/1"),
            ["CK610"],
            ["$.domains[0].manifest.frozen", "$.domains[1].manifest.frozen"],
            "head.bias, frozen on both tensor ranks, placed nowhere: the merged model would lose it",
        ),
        (
            "CK610-extra-is-a-parameter",
            TP,
            _set("extras/1/name", "head.weight"),
            ["CK610"],
            ["$.extras[1].name"],
            "a frozen parameter under a trainable parameter's name",
        ),
        (
            "CK610-locator-numel",
            PP,
            _set("extras/0/shards/0/locator/numel", 511),
            ["CK610"],
            ["$.extras[0].shards[0]"],
            "a locator of 511 elements for a [32, 16] tensor",
        ),
        (
            "CK610-locator-other-stage",
            PP,
            _set("extras/0/shards/0/domain", "pp1-tp0"),
            ["CK610"],
            ["$.extras[0].shards[0]"],
            "layer 2's frozen weight claimed by stage 1, which does not write layer 2's file",
        ),
        (
            "CK610-tie-to-nothing",
            PP,
            _set("aliases/4.weight", "0.bias"),
            ["CK610"],
            ["$.aliases['4.weight']"],
            "a tie whose owner is no tensor of the whole model",
        ),
    ]


def _source(name: str) -> dict:
    if name == BUMPED:  # index-1.0's pipeline, as `ckptspec migrate --to 1.1` writes it
        doc = json.loads((HERE / "index-1.0" / "pp2dp2-s1-fp32-ws4.json").read_text("utf-8"))
        doc["format_version"] = "1.1.0"
        return doc
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
    for name, base, edit, codes, paths, description in INVALID + invalid_semantic():
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

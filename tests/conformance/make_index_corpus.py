"""Generate the checkpoint index corpus, checkpoint-1.0/ (schema/checkpoint-1.0.schema.json).

    python tests/conformance/make_index_corpus.py          # (re)write checkpoint-1.0/
    python tests/conformance/make_index_corpus.py --check  # exit 1 if a committed file differs

Every document is the index of a real DeepSpeed checkpoint (index-1.0/: ``ckptspec generate`` of three
harness checkpoints: AutoTP tp2 x dp2 ZeRO-2 bf16, pipeline pp2 x dp2 ZeRO-1 fp32, ZeRO stage 0 bf16 with
FP16_Optimizer) or one named edit of one. Each edit states the codes it must produce and the JSON paths
of its errors, by hand: this script imports nothing from ckptspec, so the corpus is a statement of the
rules of docs/spec-checkpoint.md independent of the implementation. expected.json is written too.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "index-1.0"
CORPUS = HERE / "checkpoint-1.0"
TP, PP, S0 = "tp2dp2-s2-bf16-ws4", "pp2dp2-s1-fp32-ws4", "s0-bf16-ws2-fused"

Edit = Callable[[dict], None]


def _parts(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in path.split("/")]


def _at(doc, parts):
    for part in parts:
        doc = doc[part]
    return doc


def _set(path: str, value) -> Edit:
    """Set the value at a slash-separated path ("domains/0/size"; a key may hold dots)."""

    def edit(doc):
        *parents, last = _parts(path)
        _at(doc, parents)[last] = copy.deepcopy(value)

    return edit


def _pop(path: str) -> Edit:
    def edit(doc):
        *parents, last = _parts(path)
        _at(doc, parents).pop(last)

    return edit


def _edits(*edits: Edit) -> Edit:
    def edit(doc):
        for e in edits:
            e(doc)

    return edit


# --------------------------------------------------------------------------- valid documents


def _pieces(doc):
    """blocks.0.up.weight's two row blocks written as DeepSpeed's affine pieces, not as splits."""
    param = doc["parameters"][0]
    whole = param["shape"]
    for shard in param["shards"]:
        split, local = shard["placement"]["split"], shard["local_shape"]
        strides = [whole[1], 1]
        shard["placement"] = {
            "pieces": [
                {
                    "shape": local,
                    "source": [split["offset"] * strides[split["axis"]], strides],
                    "dest": [0, [local[1], 1]],
                }
            ]
        }


def _ranks(doc):
    """The launch's four ranks with their coordinates (optional), and every optional producer field."""
    doc["topology"]["ranks"] = [
        {"rank": r, "pipeline": 0, "tensor": r % 2, "data": r // 2, "mp_rank": r % 2} for r in range(4)
    ]
    doc["producer"].update(created="2026-12-01T09:30:00.123Z", metadata={"run": "conformance"})
    doc["domains"][0]["members"] = [0, 2]
    doc["domains"][1]["members"] = [1, 3]


def _layer_hashes(doc):
    for i, layer in enumerate(doc["layer_files"]):
        layer["hash"] = {"algorithm": "sha256", "digest": f"{i:02x}" * 32}


def _integral_floats(doc):
    """Counts written as integral floats: JSON Schema's integer accepts 2.0 (a writer must not write it)."""
    doc["domains"][0]["size"] = 2.0
    doc["layer_files"][0]["size"] = float(doc["layer_files"][0]["size"])
    doc["topology"]["degrees"]["pipeline"] = 2.0


def _newer_minor(doc):
    doc["format_version"] = "1.3.0"
    doc["future_field"] = {"x": 1}
    doc["topology"]["future_axis_note"] = "sequence"


VALID: dict[str, tuple[str, Edit | None, str]] = {
    # name: (base, edit, description)
    TP: (TP, None, "the index of a real AutoTP tp2 x dp2 ZeRO-2 bf16 checkpoint (splits along both axes, replicas)"),
    PP: (PP, None, "the index of a real pipeline pp2 x dp2 ZeRO-1 fp32 checkpoint (layer files)"),
    S0: (S0, None, "the index of a real ZeRO stage-0 bf16 checkpoint (FP16_Optimizer's masters in the model states)"),
    "tp-affine-pieces": (TP, _pieces, "a tensor-parallel split written as affine pieces"),
    "tp-ranks-members-producer": (TP, _ranks, "every optional field of the topology, the domains and the producer"),
    "pp-layer-file-hashes": (PP, _layer_hashes, "layer files with their sha256"),
    "pp-integral-float-counts": (PP, _integral_floats, "counts written as integral floats (2.0)"),
    "newer-minor-1.3.0-unknown-fields": (PP, _newer_minor, "a newer minor: unknown fields tolerated, CK004"),
}

# --------------------------------------------------------------------------- invalid documents
# (name, base, edit, codes, error paths, what is wrong). The name starts with the code it must produce.
# paths: the JSON paths of the error findings; for a schema error, where every JSON Schema engine reports
# it (ajv may add the failures of each branch of a oneOf/anyOf, always below that path).

SPLIT = "parameters/0/shards/0/placement"
LAYER_3_TENSORS = [f"$.layer_files[3].tensors['{k}']" for k in ("down.bias", "down.weight", "up.bias", "up.weight")]
INVALID: list[tuple[str, str, Edit, list[str], list[str], str]] = [
    # CK001: the index's own schema, one rule each
    ("CK001-schema-missing-layer-files", TP, _pop("layer_files"), ["CK001"], ["$"], "layer_files is required"),
    ("CK001-schema-unknown-top-level-field", TP, _set("extra", 1), ["CK001"], ["$"], "a 1.0 index has no other fields"),
    (
        "CK001-schema-semver-trailing-newline",
        TP,
        _set("format_version", "1.0.0\n"),
        ["CK001"],
        ["$.format_version"],
        "ECMA-262 '$' matches only at the very end",
    ),
    ("CK001-schema-kind-megatron", TP, _set("kind", "megatron"), ["CK001"], ["$.kind"], "kind is zero or universal"),
    (
        "CK001-schema-created-without-timezone",
        TP,
        _set("producer/created", "2026-12-01T09:30:00"),
        ["CK001"],
        ["$.producer.created"],
        "a creation time has its time zone",
    ),
    (
        "CK001-schema-degree-zero",
        TP,
        _set("topology/degrees/tensor", 0),
        ["CK001"],
        ["$.topology.degrees.tensor"],
        "a degree is positive",
    ),
    (
        "CK001-schema-degrees-source-unknown",
        TP,
        _set("topology/degrees_source", "guessed"),
        ["CK001"],
        ["$.topology.degrees_source"],
        "degrees come from the files, derived from them, or the engine",
    ),
    (
        "CK001-schema-model-parallel-size-string",
        TP,
        _set("topology/model_parallel_size", "2"),
        ["CK001"],
        ["$.topology.model_parallel_size"],
        "a degree is an integer",
    ),
    (
        "CK001-schema-rank-missing-data",
        "tp-ranks-members-producer",
        _pop("topology/ranks/3/data"),
        ["CK001"],
        ["$.topology.ranks[3]"],
        "a rank states its data-parallel coordinate",
    ),
    ("CK001-schema-no-domains", TP, _set("domains", []), ["CK001"], ["$.domains"], "an index has a domain"),
    (
        "CK001-schema-domain-size-zero",
        TP,
        _set("domains/1/size", 0),
        ["CK001"],
        ["$.domains[1].size"],
        "a domain has a rank",
    ),
    (
        "CK001-schema-coordinate-unknown-axis",
        TP,
        _set("domains/0/coordinate/sequence", 0),
        ["CK001"],
        ["$.domains[0].coordinate"],
        "pipeline, tensor, data and expert are the axes",
    ),
    (
        "CK001-schema-file-rank-negative",
        TP,
        _set("domains/0/file_ranks/mp_rank_00_model_states.pt", -1),
        ["CK001"],
        ["$.domains[0].file_ranks['mp_rank_00_model_states.pt']"],
        "a file's rank is not negative",
    ),
    (
        "CK001-schema-domain-manifest-not-object",
        TP,
        _set("domains/0/manifest", []),
        ["CK001"],
        ["$.domains[0].manifest"],
        "a domain's manifest is a document",
    ),
    (
        "CK001-schema-configured-zero-stage-4",
        S0,
        _set("domains/0/configured_zero_stage", 4),
        ["CK001"],
        ["$.domains[0].configured_zero_stage"],
        "ZeRO has stages 0 to 3",
    ),
    (
        "CK001-schema-masters-stored-in-unknown",
        S0,
        _set("domains/0/masters/stored_in", "elsewhere"),
        ["CK001"],
        ["$.domains[0].masters.stored_in"],
        "masters are in one of five named places",
    ),
    (
        "CK001-schema-master-locator-missing-numel",
        S0,
        _pop("domains/0/masters/tensors/0/numel"),
        ["CK001"],
        ["$.domains[0].masters.tensors[0]"],
        "a master locator states its numel",
    ),
    (
        "CK001-schema-master-key-nested-list",
        S0,
        _set("domains/0/masters/tensors/0/key/0", ["optimizer"]),
        ["CK001"],
        ["$.domains[0].masters.tensors[0].key[0]"],
        "a key is a list of strings and indexes",
    ),
    (
        "CK001-schema-layer-file-tensor-string",
        PP,
        _set("layer_files/0/tensor", "0"),
        ["CK001"],
        ["$.layer_files[0].tensor"],
        "a layer file's tensor rank is an integer or null",
    ),
    (
        "CK001-schema-layer-hash-uppercase",
        "pp-layer-file-hashes",
        _set("layer_files/1/hash/digest", "AB" * 32),
        ["CK001"],
        ["$.layer_files[1].hash.digest"],
        "a digest is lower-case hex",
    ),
    (
        "CK001-schema-parameter-role-frozen",
        TP,
        _set("parameters/3/role", "frozen"),
        ["CK001"],
        ["$.parameters[3].role"],
        "an index 1.0 holds trainable parameters",
    ),
    (
        "CK001-schema-parameter-dtype-unknown",
        TP,
        _set("parameters/0/dtype", "float4"),
        ["CK001"],
        ["$.parameters[0].dtype"],
        "dtypes are those of spec.md",
    ),
    (
        "CK001-schema-shape-negative",
        TP,
        _set("parameters/0/shape/1", -16),
        ["CK001"],
        ["$.parameters[0].shape[1]"],
        "a dimension is not negative",
    ),
    (
        "CK001-schema-shard-missing-local-shape",
        TP,
        _pop("parameters/0/shards/0/local_shape"),
        ["CK001"],
        ["$.parameters[0].shards[0]"],
        "a shard states its local shape",
    ),
    (
        "CK001-schema-placement-kind",
        TP,
        _set(SPLIT, "diagonal"),
        ["CK001"],
        ["$.parameters[0].shards[0].placement"],
        "a placement is whole, replicated, a split or pieces",
    ),
    (
        "CK001-schema-split-without-axis",
        TP,
        _pop(SPLIT + "/split/axis"),
        ["CK001"],
        ["$.parameters[0].shards[0].placement"],
        "a split states its axis",
    ),
    (
        "CK001-schema-piece-source-one-item",
        "tp-affine-pieces",
        _set(SPLIT + "/pieces/0/source", [0]),
        ["CK001"],
        ["$.parameters[0].shards[0].placement"],
        "an affine map is [offset, strides]",
    ),
    (
        "CK001-schema-layer-size-above-int64",
        PP,
        _set("layer_files/2/size", 2**63),
        ["CK001"],
        ["$.layer_files[2].size"],
        "a size fits in int64 (a JavaScript reader reads 2**63 as the double of 2**63 - 1: it refuses above 2**53 - 1)",
    ),
    (
        "CK001-schema-newer-minor-still-typed",
        "newer-minor-1.3.0-unknown-fields",
        _set("domains/0/size", "2"),
        ["CK001"],
        ["$.domains[0].size"],
        "a newer minor's unknown fields are tolerated, its known ones still typed",
    ),
    # CK003: another major stops everything, schema included
    (
        "CK003-format-major-2",
        TP,
        _set("format_version", "2.0.0"),
        ["CK003"],
        ["$.format_version"],
        "an index 2.0 is not read by a 1.x reader",
    ),
    (
        "CK003-format-major-2-stops-validation",
        TP,
        _edits(_set("format_version", "2.0.0"), _set("kind", "megatron")),
        ["CK003"],
        ["$.format_version"],
        "nothing but the version is checked in another major",
    ),
    # a domain's manifest: a complete 1.x document, by its own schema and rules (the index's schema takes any object)
    (
        "CK001-domain-manifest-schema",
        PP,
        _set("domains/1/manifest/layout/world_size", 0),
        ["CK001"],
        ["$.domains[1].manifest.layout.world_size"],
        "a domain's manifest breaks the manifest 1.x schema",
    ),
    (
        "CK101-domain-manifest-rule",
        PP,
        _set("domains/1/manifest/groups/0/params/0/numel", 513),
        ["CK101", "CK106"],
        ["$.domains[1].manifest.groups[0].params[0].numel", "$.domains[1].manifest.groups[0].params[1].offset"],
        "a domain's manifest breaks the manifest 1.x rules: 3.up.weight's numel is not its shape's product (CK101), "
        "so the next parameter's offset no longer follows it (CK106)",
    ),
]


def invalid_semantic() -> list[tuple[str, str, Edit, list[str], list[str], str]]:
    """Schema-valid indexes that break one CK6xx rule: JSON Schema engines accept them, a reader refuses them."""

    def swap_split(doc):
        _set("parameters/0/shards/1/placement/split/offset", 0)(doc)

    def two_primaries(doc):
        for shard in doc["parameters"][3]["shards"]:
            shard["primary"] = True

    def claimed_twice(doc):
        first = doc["parameters"][0]["shards"][0]
        doc["parameters"][1]["shards"][0].update(local_name=first["local_name"], local_shape=first["local_shape"])

    def weights_as_masters(doc):
        for loc in doc["domains"][0]["masters"]["tensors"]:
            loc.update(key=["module", loc["param"]], dtype="bfloat16")

    def shared_file_size(doc):
        doc["domains"][1]["manifest"]["files"].append({**doc["domains"][0]["manifest"]["files"][0], "size": 1})

    rank_file = "domains/1/file_ranks/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    return [
        (
            "CK602-model-parallel-size",
            TP,
            _set("topology/model_parallel_size", 4),
            ["CK602"],
            ["$.topology.model_parallel_size"],
            "model_parallel_size is pipeline x tensor",
        ),
        (
            "CK602-coordinate-outside-degree",
            PP,
            _set("domains/1/coordinate/pipeline", 2),
            ["CK602", "CK607"],
            [
                "$.domains",
                "$.domains[1].coordinate.pipeline",
                *LAYER_3_TENSORS,
                "$.layer_files[4].tensors.bias",
                "$.layer_files[4].tensors.weight",
            ],
            "a coordinate counts from 0 below its degree; stage 1 then has no domain (CK602 on $.domains), so the "
            "layer files it wrote belong to no stage that holds their tensors (CK607)",
        ),
        (
            "CK603-domain-size-not-data-degree",
            TP,
            _set("domains/0/size", 4),
            ["CK603"],
            ["$.domains[0].size"],
            "a data-parallel domain has the data degree's ranks",
        ),
        (
            "CK603-file-rank-mismatch",
            TP,
            _set(rank_file, 0),
            ["CK603"],
            ["$.domains[1].file_ranks['bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt']"],
            "a file named for rank 1 recorded as rank 0's",
        ),
        (
            "CK604-shared-file-size",
            PP,
            shared_file_size,
            ["CK603", "CK604"],
            ["$.domains[1].file_ranks", "$.domains[1].manifest.files[3]"],
            "stage 0's model-states file listed by stage 1's domain too, with another size (CK604); the domain's "
            "file_ranks do not name it (CK603)",
        ),
        (
            "CK605-split-overlap",
            TP,
            swap_split,
            ["CK605"],
            ["$.parameters[0].shards"],
            "two row blocks of blocks.0.up.weight overlap and leave a gap",
        ),
        (
            "CK605-two-primaries",
            TP,
            two_primaries,
            ["CK605"],
            ["$.parameters[3].shards"],
            "a replicated parameter has one primary copy",
        ),
        (
            "CK606-parameter-unclaimed",
            TP,
            _pop("parameters/0"),
            ["CK606"],
            ["$.domains[0].manifest.groups", "$.domains[1].manifest.groups"],
            "blocks.0.up.weight dropped: both tensor ranks' blocks of it are claimed by no whole-model parameter",
        ),
        (
            "CK606-shard-claimed-twice",
            PP,
            claimed_twice,
            ["CK605", "CK606"],
            ["$.domains[0].manifest.groups", "$.parameters[1].shards[0]", "$.parameters[1].shards[0].local_shape"],
            "0.bias's shard claims 0.weight, claimed already (CK606; 0.bias is then unclaimed, CK606 on the groups), "
            "and its local shape [16, 16] is not the whole [16] that placement 'whole' says (CK605)",
        ),
        (
            "CK607-layer-of-other-stage",
            PP,
            _set("layer_files/3/pipeline", 0),
            ["CK607"],
            LAYER_3_TENSORS,
            "layer 3's file written by stage 0, which does not own it (each of its four tensors)",
        ),
        (
            "CK608-split-from-nowhere",
            TP,
            _set("parameters/0/placement_source", "none"),
            ["CK608"],
            ["$.parameters[0].placement_source"],
            "a split placement without a source",
        ),
        (
            "CK609-weights-as-masters",
            S0,
            weights_as_masters,
            ["CK609"],
            ["$.domains[0].masters.tensors[0]"],
            "the bf16 module weights located as the fp32 masters",
        ),
    ]


# --------------------------------------------------------------------------- writing


def render(doc) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


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
    for name, base, edit, codes, paths, description in INVALID + invalid_semantic():
        doc = copy.deepcopy(docs[base])
        edit(doc)
        rel = f"invalid/{name}.json"
        out[CORPUS / rel] = render(doc)
        expected[rel] = {
            "valid": False,
            "codes": sorted(codes),
            "warnings": ["CK004"] if base.startswith("newer-minor") else [],
            "paths": sorted(paths),
            "description": f"{description} (from valid/{base}.json)",
        }
    out[CORPUS / "expected.json"] = json.dumps(dict(sorted(expected.items())), indent=2, ensure_ascii=False) + "\n"
    return out


def sync(files: dict[Path, str], corpus_dir: Path, description: str, argv: list[str] | None = None) -> int:
    """A generator script's command line: write ``files`` into ``corpus_dir`` (and remove the corpus files it no
    longer makes), or with ``--check`` only say which differ from the committed ones (exit 1)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args(argv)
    stale = [p for p, text in files.items() if not p.exists() or p.read_text("utf-8") != text]
    extra = [p for p in corpus_dir.glob("*/*.json") if p not in files]
    if args.check:
        if stale or extra:
            names = [p.relative_to(HERE).as_posix() for p in stale + extra]
            print("out of date: " + ", ".join(names), file=sys.stderr)
            return 1
        return 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path], "utf-8")
    for path in extra:
        path.unlink()
    print(f"wrote {len(stale)} file(s), removed {len(extra)} in {corpus_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return sync(corpus(), CORPUS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())

"""The models hold their constraints in their types (#38): strict, unknown keys refused, no Python
validator on the hot path; integral floats are made ints once where a document is loaded; a newer
minor's fields are read by the models' tolerant twins.

tests/unit/format/test_agreement.py proves models and schema give the same verdict on the corpus and
hundreds of mutations; these are the pieces that verdict rests on.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from ckptspec.format import dcp_models, index_models, models, partition
from ckptspec.format.integral import integral_floats
from ckptspec.format.models import Digest, Layout, Manifest, Param, TolerantDigest
from ckptspec.format.tolerant import from_document, tolerant
from ckptspec.format.validate import validate_document

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"
PARAM = {"name": "w", "shape": [2, 3], "numel": 6, "dtype": "float32", "offset": 0, "padding": 0}


def _models(module) -> list[type[BaseModel]]:
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, BaseModel) and v is not BaseModel]


@pytest.mark.parametrize(
    "cls", sorted({*_models(models), *_models(index_models), *_models(dcp_models)} - {TolerantDigest}, key=str)
)
def test_no_model_runs_a_python_validator(cls):
    decorators = cls.__pydantic_decorators__
    assert not (decorators.validators or decorators.field_validators or decorators.model_validators), cls
    assert cls.model_config.get("strict") is True and cls.model_config.get("extra") == "forbid"


@pytest.mark.parametrize(
    "field,value", [("numel", True), ("numel", 6.0), ("shape", [2.0, 3]), ("name", b"w"), ("shape", (2, 3))]
)
def test_the_models_refuse_what_json_schema_would_not_give_them(field, value):
    with pytest.raises(ValidationError):
        Param(**{**PARAM, field: value})


def test_unknown_keys_are_refused_by_the_strict_models_and_kept_by_their_twins():
    row = {**PARAM, "future": 1.5}
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Param.model_validate(row)
    kept = tolerant(Param).model_validate(row)
    assert isinstance(kept, Param) and kept.model_dump(exclude_unset=True) == row


def test_a_twin_keeps_unknown_fields_at_every_depth():
    doc = json.loads(EXAMPLE.read_text())
    doc["format_version"] = "1.7.0"
    doc["future"] = {"a": [1.0, None]}
    doc["groups"][0]["params"][0]["future"] = 3.0  # not an integer place: stays a float
    doc["groups"][0]["params"][0]["digest"] = {"blake3": "00"}  # another algorithm stands in for sha256
    with pytest.raises(ValidationError):
        Manifest.model_validate(doc)
    read = from_document(Manifest, doc)
    assert read.to_dict() == doc and type(read.to_dict()["groups"][0]["params"][0]["future"]) is float
    report = validate_document(doc)
    assert report.ok and report.manifest.to_dict() == doc


def test_a_digest_names_one_algorithm_at_least():
    for cls in (Digest, tolerant(Digest)):
        with pytest.raises(ValidationError):
            cls.model_validate({})
    assert Digest(sha256="0" * 64).model_dump() == {"sha256": "0" * 64}


def test_integral_floats_become_ints_only_where_the_models_hold_an_integer():
    doc = json.loads(EXAMPLE.read_text())
    doc["layout"]["world_size"] = 2.0
    doc["groups"][0]["params"][0]["shape"] = [float(d) for d in doc["groups"][0]["params"][0]["shape"]]
    doc["optimizer"]["groups"][0]["step"] = 3.0  # a number: the schema takes 3.0 as it is
    doc["optimizer"]["groups"][0]["hyperparameters"]["lr"] = 1.0
    before = copy.deepcopy(doc)
    made = integral_floats(doc, Manifest)
    assert doc == before  # a copy: the caller's data is left as it was
    assert type(made["layout"]["world_size"]) is int
    assert {type(d) for d in made["groups"][0]["params"][0]["shape"]} == {int}
    assert type(made["optimizer"]["groups"][0]["step"]) is float
    assert type(made["optimizer"]["groups"][0]["hyperparameters"]["lr"]) is float
    assert Manifest.model_validate(made).to_dict() == made
    assert integral_floats(made, Manifest) is made  # nothing left to change: no copy
    assert validate_document(doc).ok  # the loader does the same


def test_integral_floats_of_a_checkpoint_index_union():
    piece = {"pieces": [{"shape": [2.0], "source": [0.0, [1.0]], "dest": [0, [1]]}]}
    made = integral_floats(piece, index_models.PiecesPlacement)
    assert made == {"pieces": [{"shape": [2], "source": [0, [1]], "dest": [0, [1]]}]}
    assert type(made["pieces"][0]["source"][0]) is int
    split = integral_floats({"split": {"axis": 0.0, "offset": 1.0, "length": 2.0}}, index_models.Placement)
    assert split == {"split": {"axis": 0, "offset": 1, "length": 2}} and type(split["split"]["axis"]) is int
    assert integral_floats("replicated", index_models.Placement) == "replicated"


def test_layout_zero_stage_bounds_are_in_the_type():
    layout = json.loads(EXAMPLE.read_text())["layout"]
    with pytest.raises(ValidationError):
        Layout.model_validate({**layout, "zero_stage": 4})
    assert Layout.model_validate({**layout, "zero_stage": 3}).zero_stage == 3


COLUMNS = (["a", "b.weight", "c"], [(2, 3), (), (0,)], [6, 1, 0], ["float32", "bfloat16", "int8"], [0, 6, 7], [0, 1, 2])


def test_a_groups_params_made_in_bulk_are_the_validated_ones():
    made = partition._params(*COLUMNS)
    validated = [Param(**dict(zip(partition._FIELDS, (n, list(s), *rest)))) for n, s, *rest in zip(*COLUMNS)]
    assert made == validated and partition._bulk  # the bulk way was taken
    for a, b in zip(made, validated):
        assert (a.model_fields_set, a.model_extra, a.model_dump(exclude_unset=True)) == (
            b.model_fields_set,
            b.model_extra,
            b.model_dump(exclude_unset=True),
        )
    made[0].shape.append(4)
    assert COLUMNS[1][0] == (2, 3)  # a shape of its own


@pytest.mark.parametrize("column,value", [(0, ""), (1, (2.0,)), (2, True), (3, "float4"), (4, -1), (5, 2**63)])
def test_a_column_that_does_not_validate_raises_what_its_row_raises(column, value):
    columns = [list(c) for c in COLUMNS]
    columns[column][1] = value
    with pytest.raises(ValidationError) as bulk:
        partition._params(*columns)
    with pytest.raises(ValidationError) as row:
        Param(**dict(zip(partition._FIELDS, (columns[0][1], list(columns[1][1]), *(c[1] for c in columns[2:])))))
    assert bulk.value.errors() == row.value.errors()


def test_a_pieces_placement_reads_its_json_arrays():
    """``source``/``dest`` are JSON arrays ``[offset, strides]``: strict mode refused every list where a tuple is
    typed, so a checkpoint index with a pieces placement was CK002 before it was ever read."""
    doc = {"shape": [2, 3], "source": [4, [3, 1]], "dest": [0, [3, 1]]}
    piece = index_models.Piece.model_validate(json.loads(json.dumps(doc)))
    assert piece.source == (4, [3, 1]) and piece.dest == (0, [3, 1])


@pytest.mark.parametrize("bad", [[True, [1]], [0.0, [1]], ["1", [1]], [0, [True]], [-1, [1]], [0, [1], 2], [0]])
def test_a_pieces_offset_and_strides_stay_strict(bad):
    with pytest.raises(ValidationError):
        index_models.Piece.model_validate({"shape": [2], "source": bad, "dest": [0, [1]]})

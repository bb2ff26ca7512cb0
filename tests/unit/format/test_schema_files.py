"""The shipped JSON Schema files: one copy, well-formed draft 2020-12, documented.

``schema/`` is the normative location; ``ckptspec/schemas`` (package data, what
``ckptspec schema`` prints and ``validate`` uses) must be the very same directory.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from ckptspec.format.schemas import DCP_SCHEMAS, INDEX_SCHEMAS, MANIFEST_SCHEMAS, REPORT_SCHEMAS, schema

ROOT = Path(__file__).resolve().parents[3]
SCHEMA_DIR = ROOT / "schema"
PACKAGE_DIR = ROOT / "ckptspec" / "schemas"
SCHEMA_FILES = sorted(p.name for p in SCHEMA_DIR.glob("*.json"))
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


def test_package_schemas_is_the_schema_directory():
    assert PACKAGE_DIR.exists()
    assert PACKAGE_DIR.resolve() == SCHEMA_DIR.resolve()
    assert PACKAGE_DIR.samefile(SCHEMA_DIR)


def test_installed_package_data_matches_schema_directory():
    shipped = resources.files("ckptspec").joinpath("schemas")
    names = sorted(p.name for p in shipped.iterdir() if p.name.endswith(".json"))
    assert names == SCHEMA_FILES
    for name in names:
        assert shipped.joinpath(name).read_bytes() == (SCHEMA_DIR / name).read_bytes()


def test_every_schema_file_is_registered():
    assert SCHEMA_FILES, "no schema files found"
    registered = (
        set(MANIFEST_SCHEMAS.values())
        | set(REPORT_SCHEMAS.values())
        | set(INDEX_SCHEMAS.values())
        | set(DCP_SCHEMAS.values())
    )
    assert set(SCHEMA_FILES) == registered
    for version, name in {**MANIFEST_SCHEMAS, **INDEX_SCHEMAS, **DCP_SCHEMAS}.items():
        assert f"-{version}.schema.json" in name


@pytest.mark.parametrize("name", SCHEMA_FILES)
def test_schema_file_is_valid_draft_2020_12(name):
    doc = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    assert doc["$schema"] == DRAFT_2020_12
    Draft202012Validator.check_schema(doc)
    assert schema(name) == doc  # the registry loads this very file


@pytest.mark.parametrize("name", SCHEMA_FILES)
def test_schema_id_names_its_version(name):
    doc = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    version = re.search(r"-(\d+\.\d+)\.schema\.json$", name)
    assert version, f"{name} does not end in -MAJOR.MINOR.schema.json"
    assert version.group(1) in doc["$id"]
    assert doc["$id"].endswith("/" + name)
    assert version.group(1) in doc["title"]


@pytest.mark.parametrize("name", SCHEMA_FILES)
def test_every_def_has_a_comment(name):
    doc = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    assert isinstance(doc.get("$comment"), str) and doc["$comment"].strip()
    for def_name, definition in doc.get("$defs", {}).items():
        comment = definition.get("$comment")
        assert isinstance(comment, str) and comment.strip(), f"$defs/{def_name} has no $comment"


@pytest.mark.parametrize("name", SCHEMA_FILES)
def test_every_ref_resolves(name):
    doc = json.loads((SCHEMA_DIR / name).read_text("utf-8"))

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    defs = doc.get("$defs", {})
    used = set()
    for ref in refs(doc):
        assert ref.startswith("#/$defs/"), ref
        assert ref.split("/")[-1] in defs, ref
        used.add(ref.split("/")[-1])
    assert used == set(defs), f"unused $defs: {set(defs) - used}"

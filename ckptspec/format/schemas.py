"""The shipped JSON Schemas (package data: ``ckptspec/schemas`` is ``schema/``), the one
validator factory, and the findings the reference validator gives.

jsonschema is imported on first use: commands that never validate against a schema
(generate, reconstruct) start faster.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

from ..findings import Finding, finding, json_path
from .version import minor_line

# format minor version -> schema file; a released file is never edited.
MANIFEST_SCHEMAS = {"1.0": "manifest-1.0.schema.json", "1.1": "manifest-1.1.schema.json"}
LATEST_MANIFEST = "1.1"
REPORT_SCHEMA = "report-1.0.schema.json"
# The checkpoint index (tensor/pipeline parallel checkpoints): its own document kind and version line.
INDEX_SCHEMA = "checkpoint-1.0.schema.json"
_MAX_MESSAGE = 300

# `validate --format json` report version -> schema file. 1.1 adds `fetched` (a target at a URL) and
# accepts 1.0 reports too, so the latest (what `ckptspec schema --report` prints) validates every report.
REPORT_SCHEMAS = {"1.0": REPORT_SCHEMA, "1.1": "report-1.1.schema.json"}
LATEST_REPORT = "1.1"
INDEX_SCHEMAS = {"1.0": INDEX_SCHEMA, "1.1": "checkpoint-1.1.schema.json"}
LATEST_INDEX = "1.1"
# The torch DCP document (a torch.distributed.checkpoint directory): a kind and version line of its own.
DCP_SCHEMAS = {"1.0": "dcp-1.0.schema.json"}
LATEST_DCP = "1.0"

# Every shipped schema by document kind (`ckptspec schema --list`): kind -> ({MAJOR.MINOR: file}, latest).
SCHEMAS_BY_KIND = {
    "manifest": (MANIFEST_SCHEMAS, LATEST_MANIFEST),
    "checkpoint-index": (INDEX_SCHEMAS, LATEST_INDEX),
    "report": (REPORT_SCHEMAS, LATEST_REPORT),
    "dcp": (DCP_SCHEMAS, LATEST_DCP),
}


def schema_text(filename: str) -> str:
    return resources.files("ckptspec").joinpath("schemas", filename).read_text("utf-8")


@cache
def schema(filename: str) -> dict:
    return json.loads(schema_text(filename))


def manifest_schema_file(version: str = LATEST_MANIFEST) -> str:
    """``version`` is ``MAJOR.MINOR`` (``1.0``) or a full ``1.0.0``."""
    try:
        return MANIFEST_SCHEMAS[minor_line(version)]
    except KeyError:
        known = ", ".join(sorted(MANIFEST_SCHEMAS))
        raise KeyError(f"no schema for format version {version} (known: {known})") from None


def schema_file(kind: str, version: str | None = None) -> str:
    """The shipped schema of a document kind (``SCHEMAS_BY_KIND``) at ``version`` (``MAJOR.MINOR`` or
    a full ``1.0.0``; default the latest). Raises ``KeyError`` naming the versions known for the kind."""
    files, latest = SCHEMAS_BY_KIND[kind]
    try:
        return files[minor_line(version) if version else latest]
    except KeyError:
        known = ", ".join(sorted(files))
        raise KeyError(f"no {kind} schema for format version {version} (known: {known})") from None


def schema_version_of(doc: Any) -> str:
    """The ``MAJOR.MINOR`` whose schema checks ``doc``: its own version when this release ships that
    schema, else the latest (a newer minor is read with the latest schema, its unknown fields
    tolerated; a malformed version is reported by the schema)."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    line = minor_line(version) if isinstance(version, str) else None
    return line if line in MANIFEST_SCHEMAS else LATEST_MANIFEST


@cache
def ecma_regex(pattern: str) -> re.Pattern:
    # JSON Schema patterns are ECMA-262: '$' matches only at the very end. Python's
    # '$' also matches before a final newline, so "1.0.0\n" would pass; use \Z.
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


@cache
def validator_class():
    """The reference validator class: draft 2020-12 with ECMA-262 pattern anchors."""
    from jsonschema import Draft202012Validator, ValidationError, validators

    def pattern(validator, value, instance, schema):
        if validator.is_type(instance, "string") and not ecma_regex(value).search(instance):
            yield ValidationError(f"{instance!r} does not match {value!r}")

    return validators.extend(Draft202012Validator, {"pattern": pattern})


@cache
def validator(filename: str):
    """The reference validator of a shipped schema."""
    return validator_class()(schema(filename))


@cache
def fast_validator(filename: str):
    """A compiled validator (``jsonschema-rs``, Rust) for the fast path, or None.

    It only answers valid/invalid; findings always come from ``validator`` (the
    reference). Its regexes follow ECMA-262 like the reference's. None when the
    package is not installed: everything then goes through the reference.
    """
    try:
        import jsonschema_rs
    except ImportError:
        return None
    return jsonschema_rs.validator_for(schema(filename))


def fast_accepts(filename: str, doc: Any) -> bool:
    """The compiled validator's verdict on ``doc`` against a shipped schema; False when unsure (no
    compiled validator, data it cannot take): then the reference decides, and gives the findings."""
    fast = fast_validator(filename)
    if fast is None:
        return False
    try:
        return fast.is_valid(doc)
    except (ValueError, TypeError, OverflowError, RecursionError):  # data it cannot convert
        return False


def _message(error) -> str:
    try:
        message = error.message
    except RecursionError:  # jsonschema repr()s the offending value; junk can nest deeply
        return f"value breaks the schema rule '{error.validator}' (too deeply nested to print)"
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


def schema_findings(
    doc: Any, schema: dict | None = None, *, allow_unknown: bool = False, rules_of: str = "(see docs/spec.md)"
) -> list[Finding]:
    """CK001 findings of the reference validator, sorted by path.

    ``schema``: a schema document (a registered draft); default the shipped manifest schema of
    the document's own version (``schema_version_of``): a 1.0 document may not carry 1.1's
    fields. ``allow_unknown`` skips ``additionalProperties`` (a newer minor's fields).
    ``rules_of`` ends the hint, saying where the broken rule is documented.
    """
    check = validator(manifest_schema_file(schema_version_of(doc))) if schema is None else validator_class()(schema)
    found = []
    try:
        for error in check.iter_errors(doc):
            if allow_unknown and error.validator == "additionalProperties":
                continue
            found.append(
                finding(
                    "CK001",
                    json_path(*error.absolute_path),
                    _message(error),
                    f"the document breaks the JSON Schema rule '{error.validator}' {rules_of}",
                )
            )
    except RecursionError:  # jsonschema repr()s offending values; junk can nest ~1000 deep
        found.append(
            finding(
                "CK001", "$", "the document nests too deeply to be a manifest", "a manifest nests at most a few levels"
            )
        )
    found.sort(key=lambda f: f.path)
    return found

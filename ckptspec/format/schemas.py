"""The shipped JSON Schemas, loaded from package data (``ckptspec/schemas`` is ``schema/``)."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources

# format minor version -> schema file; a released file is never edited.
MANIFEST_SCHEMAS = {"1.0": "manifest-1.0.schema.json"}
LATEST_MANIFEST = "1.0"
REPORT_SCHEMA = "report-1.0.schema.json"


def schema_text(filename: str) -> str:
    return resources.files("ckptspec").joinpath("schemas", filename).read_text("utf-8")


@lru_cache(maxsize=None)
def schema(filename: str) -> dict:
    return json.loads(schema_text(filename))


@lru_cache(maxsize=None)
def _ecma_regex(pattern: str) -> re.Pattern:
    # JSON Schema patterns are ECMA-262: '$' matches only at the very end. Python's
    # '$' also matches before a final newline, so "1.0.0\n" would pass; use \Z.
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


@lru_cache(maxsize=None)
def validator(filename: str):
    """The reference validator: draft 2020-12 with ECMA-262 pattern anchors.

    jsonschema is imported here, on first use: commands that never validate against the
    schema (generate, reconstruct) start faster.
    """
    from jsonschema import Draft202012Validator, ValidationError, validators

    def pattern(validator, pattern, instance, schema):
        if validator.is_type(instance, "string") and not _ecma_regex(pattern).search(instance):
            yield ValidationError(f"{instance!r} does not match {pattern!r}")

    return validators.extend(Draft202012Validator, {"pattern": pattern})(schema(filename))


@lru_cache(maxsize=None)
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


def manifest_schema_file(version: str = LATEST_MANIFEST) -> str:
    """``version`` is ``MAJOR.MINOR`` (``1.0``) or a full ``1.0.0``."""
    key = ".".join(version.split(".")[:2])
    try:
        return MANIFEST_SCHEMAS[key]
    except KeyError:
        known = ", ".join(sorted(MANIFEST_SCHEMAS))
        raise KeyError(f"no schema for format version {version} (known: {known})") from None

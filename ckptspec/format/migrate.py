"""Format versions: a registry of migrations between them, and the checks around one.

A migration is a function on plain decoded documents (``dict -> dict``) registered
for one step between two ``MAJOR.MINOR`` format versions. ``migrate_document``
finds the shortest chain of registered steps, checks the input against the schema
of its own version first, runs the steps, and checks the result against the schema
of the target version: a migration can never hand out a document its target
version would refuse.

This release knows formats 1.0 and 1.1 and registers both steps between them (below); a
later release registers its own steps (and the schema of each version) here. Tests
register draft versions temporarily with ``registered(...)``. See docs/versioning.md.

Going up from 1.0 is a version bump: 1.1 only adds OPTIONAL fields, and what fills them
(locators, digests, the optimizer state) is in the checkpoint's files, not in the 1.0 document
(``ckptspec migrate --checkpoint``, ``deepspeed/upgrade.py``). Going down drops exactly the
fields 1.1 added (``V1_1_FIELDS``), each reported as the warning CK313.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInput, MigrationError
from ..findings import Finding, finding, has_errors, json_path
from .schemas import schema_findings
from .validate import validate_document
from .version import FORMAT_VERSION, SUPPORTED_MAJOR, version_key, version_order

Migration = Callable[[dict], dict]

_MIGRATIONS: dict[tuple[str, str], Migration] = {}
# Schemas of versions this release does not ship (drafts, or older/newer majors a
# registered migration reads or writes): "MAJOR.MINOR" -> JSON Schema document.
_SCHEMAS: dict[str, dict] = {}


def register_migration(from_version: str, to_version: str, fn: Migration | None = None):
    """Register ``fn`` as the step ``from_version -> to_version`` (usable as a decorator)."""
    key = (version_key(from_version), version_key(to_version))
    if key[0] == key[1]:
        raise ValueError("a migration must change the version")

    def add(function: Migration) -> Migration:
        if key in _MIGRATIONS and _MIGRATIONS[key] is not function:
            raise ValueError(f"a migration {key[0]} -> {key[1]} is already registered")
        _MIGRATIONS[key] = function
        return function

    return add(fn) if fn is not None else add


def unregister_migration(from_version: str, to_version: str) -> None:
    _MIGRATIONS.pop((version_key(from_version), version_key(to_version)), None)


def register_schema(version: str, schema: dict | str | os.PathLike) -> None:
    """Register the JSON Schema of a version this release does not ship (a dict or a file)."""
    if isinstance(schema, dict):
        loaded = schema
    else:
        with open(schema, encoding="utf-8") as fh:
            loaded = json.load(fh)
    _SCHEMAS[version_key(version)] = loaded


def unregister_schema(version: str) -> None:
    _SCHEMAS.pop(version_key(version), None)


@contextlib.contextmanager
def registered(migrations: Mapping[tuple[str, str], Migration] = {}, schemas: Mapping[str, Any] = {}) -> Iterator[None]:
    """Register migrations and schemas for the duration of a ``with`` block (tests, drafts)."""
    added_migrations, added_schemas = [], []
    try:
        for (source, target), fn in migrations.items():
            register_migration(source, target, fn)
            added_migrations.append((source, target))
        for version, schema in schemas.items():
            register_schema(version, schema)
            added_schemas.append(version)
        yield
    finally:
        for source, target in added_migrations:
            unregister_migration(source, target)
        for version in added_schemas:
            unregister_schema(version)


def known_migrations() -> list[tuple[str, str]]:
    return sorted(_MIGRATIONS, key=lambda k: (version_order(k[0]), version_order(k[1])))


def migration_path(from_version: str, to_version: str) -> list[tuple[str, str]] | None:
    """The shortest chain of registered steps (``[]`` when the versions are equal), or None."""
    source, target = version_key(from_version), version_key(to_version)
    if source == target:
        return []
    previous: dict[str, tuple[str, str]] = {}
    queue = deque([source])
    seen = {source}
    while queue:
        here = queue.popleft()
        for step in known_migrations():
            if step[0] != here or step[1] in seen:
                continue
            previous[step[1]] = step
            if step[1] == target:
                path = [step]
                while path[0][0] != source:
                    path.insert(0, previous[path[0][0]])
                return path
            seen.add(step[1])
            queue.append(step[1])
    return None


def validate_own_version(doc: Any) -> list[Finding]:
    """Validate a document against its own format version, as far as this release knows it.

    A version with a registered schema (a draft, another major) is checked against that
    schema; one of the supported major is then also checked by the semantic rules. Other
    versions go through ``validate_document`` and its version gate (an unknown major
    is CK003; a newer minor is read with the CK004 warning).
    """
    version = doc.get("format_version") if isinstance(doc, dict) else None
    try:
        key = version_key(version) if isinstance(version, str) else None
    except ValueError:
        key = None
    if key is None or key not in _SCHEMAS:
        return validate_document(doc).findings
    findings = schema_findings(doc, _SCHEMAS[key], rules_of="of its format version")
    if has_errors(findings) or int(key.split(".")[0]) != SUPPORTED_MAJOR:
        return findings
    # The registered schema checked every field; the rules check the arithmetic.
    return [f for f in validate_document(doc).findings if f.code != "CK004"]


def _key_paths(doc: Any) -> set[str]:
    paths: set[str] = set()
    stack: list[tuple[Any, tuple]] = [(doc, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                paths.add(json_path(*where, key))
                stack.append((item, where + (key,)))
        elif isinstance(value, list):
            stack.extend((item, where + (i,)) for i, item in enumerate(value))
    return paths


def _outermost(paths: set[str]) -> list[str]:
    """Drop the paths that lie inside another path of the set (``$.a.b`` when ``$.a`` is there)."""
    out = []
    for path in sorted(paths):
        cuts = [i for i, ch in enumerate(path) if ch in ".[" and i > 1]
        if not any(path[:i] in paths for i in cuts):
            out.append(path)
    return out


@dataclass
class MigrationResult:
    document: dict
    steps: list[tuple[str, str]]
    findings: list[Finding] = field(default_factory=list)  # input and output warnings, CK313 for dropped fields


def migrate_document(doc: Any, to_version: str, name: str = "<input>") -> MigrationResult:
    """Migrate a decoded document to ``to_version`` (``MAJOR.MINOR`` or full).

    Raises:
        MigrationError: CK311 when no chain of registered migrations leads there,
            CK312 when the result is not valid at its version (a bug in a migration).
        InvalidInput: the input itself is invalid at its own version (its findings).
    """
    target = version_key(to_version)
    if isinstance(doc, dict) and doc.get("format") == "ckptspec.checkpoint":
        # Not a second dispatch: documents.migrate hands an index to migrate_index. This only keeps a
        # direct caller from reading an index as a broken manifest (nine CK001).
        raise MigrationError(
            "CK005",
            f"this is a checkpoint index (format ckptspec.checkpoint {doc.get('format_version')}), not a manifest",
            "ckptspec.format.documents.migrate migrates either kind (an index: the manifest of each domain)",
            name,
        )
    version = doc.get("format_version") if isinstance(doc, dict) else None
    try:
        source = version_key(version) if isinstance(version, str) else None
    except ValueError:
        source = None
    if source is None:
        raise InvalidInput(name, validate_own_version(doc))
    path = migration_path(source, target)
    if path is None:
        known = ", ".join(f"{a} -> {b}" for a, b in known_migrations()) or "none"
        if target == version_key(FORMAT_VERSION):
            hint = (
                f"format {source} is newer than this ckptspec's {target}; a release that knows {source} "
                f"can migrate it down, or read it here as is (unknown fields are kept with a warning)"
            )
        else:
            hint = (
                f"this ckptspec reads and writes format {version_key(FORMAT_VERSION)}; a ckptspec release "
                f"that knows format {target} can migrate to it"
            )
        raise MigrationError(
            "CK311", f"no migration from format {source} to {target} (registered: {known})", hint, name
        )
    findings = validate_own_version(doc)
    if has_errors(findings):
        raise InvalidInput(name, findings)
    warnings = [f for f in findings if f.severity == "warning"]
    result = copy.deepcopy(doc)
    before = _key_paths(result) if path else set()
    for step in path:
        result = _MIGRATIONS[step](copy.deepcopy(result))
        if not isinstance(result, dict):
            raise MigrationError(
                "CK312",
                f"the {step[0]} -> {step[1]} migration returned {type(result).__name__}, not an object",
                "this is a bug in the migration; please report it",
                name,
            )
        try:
            reached = version_key(result.get("format_version", ""))
        except ValueError:
            reached = None
        if reached != step[1]:
            result["format_version"] = f"{step[1]}.0"
    if path:
        warnings += [
            finding(
                "CK313",
                where,
                f"format {target} has no place for this field; the migration dropped it",
                "keep the original document if you need the field",
                severity="warning",
            )
            for where in _outermost(before - _key_paths(result))
        ]
    out_findings = validate_own_version(result)
    if has_errors(out_findings):
        first = next(f for f in out_findings if f.severity == "error")
        raise MigrationError(
            "CK312",
            f"the migrated document is not valid format {target}: {first.path}: {first.code} {first.message}",
            "this is a bug in a registered migration; the output was not written",
            name,
        )
    return MigrationResult(
        result, path, warnings + [f for f in out_findings if f.severity == "warning" and f not in warnings]
    )


# Where format 1.1 added fields to 1.0: (section, keys). Going down drops exactly these.
V1_1_FIELDS = {
    "document": ("optimizer", "save"),
    "layout": ("byte_order",),
    "param": ("digest", "model_digest", "state_digests"),
    "tensor": ("digest",),  # frozen parameters and buffers
    "file": ("tensors", "model_weights", "state_partitions"),
}


def _up_1_0_to_1_1(doc: dict) -> dict:
    doc["format_version"] = "1.1.0"
    return doc


def _down_1_1_to_1_0(doc: dict) -> dict:
    def drop(obj: Any, keys: tuple[str, ...]) -> None:
        if isinstance(obj, dict):
            for key in keys:
                obj.pop(key, None)

    drop(doc, V1_1_FIELDS["document"])
    drop(doc.get("layout"), V1_1_FIELDS["layout"])
    for group in doc.get("groups", []):
        for param in group.get("params", []) if isinstance(group, dict) else []:
            drop(param, V1_1_FIELDS["param"])
    for section in ("frozen", "buffers"):
        for item in doc.get(section, []):
            drop(item, V1_1_FIELDS["tensor"])
    for f in doc.get("files", []):
        drop(f, V1_1_FIELDS["file"])
    doc["format_version"] = "1.0.0"
    return doc


register_migration("1.0", "1.1", _up_1_0_to_1_1)
register_migration("1.1", "1.0", _down_1_1_to_1_0)

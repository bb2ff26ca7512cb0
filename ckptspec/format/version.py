"""The manifest format version this package reads and writes, and every parse of a version.

Kept apart from ``models`` (which imports pydantic) so that ``ckptspec validate`` can gate
on the version without paying for the models it may not build.
"""

from __future__ import annotations

import re
from typing import Final

from ..findings import Finding, finding, json_path

FORMAT_NAME: Final = "ckptspec.manifest"
FORMAT_VERSION = "1.1.0"
SUPPORTED_MAJOR, SUPPORTED_MINOR = (int(x) for x in FORMAT_VERSION.split(".")[:2])

# The schema's semver pattern, ASCII digits only (str.isdigit() accepts '²').
_SEMVER = re.compile(r"(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\Z", re.ASCII)
_PART = re.compile(r"(0|[1-9][0-9]{0,5})\Z", re.ASCII)


def version_key(version: str) -> str:
    """``"1.1.0"`` or ``"1.1"`` -> ``"1.1"``; anything else raises ``ValueError``."""
    parts = str(version).split(".")
    if len(parts) not in (2, 3) or not all(_PART.match(p) for p in parts):
        raise ValueError(f"{version!r} is not a format version such as 1.0 or 1.0.0")
    return f"{int(parts[0])}.{int(parts[1])}"


def version_order(version: str) -> tuple[int, ...]:
    """A sort key of ``"1.10"`` after ``"1.9"`` (numbers, not text)."""
    return tuple(map(int, version.split(".")))


def full_version(version: str) -> str:
    """``"1.1"`` -> ``"1.1.0"`` (a full version is returned unchanged)."""
    key = version_key(version)
    return version if str(version).count(".") == 2 else f"{key}.0"


def minor_line(version: str) -> str:
    """The ``MAJOR.MINOR`` prefix of a version, unchecked: a lookup key (``"1.0.3"`` -> ``"1.0"``)."""
    return ".".join(str(version).split(".")[:2])


def version_findings(doc: dict) -> tuple[list[Finding], bool]:
    """Gate on the format version before anything else.

    Returns (findings, stop): an unknown major stops validation; a newer minor is
    read with a warning, keeping fields this reader does not know. A missing or
    malformed version gives nothing here: the schema reports it.
    """
    version = doc.get("format_version")
    if not isinstance(version, str) or not _SEMVER.match(version):
        return [], False
    major, minor = (int(part) for part in version.split(".")[:2])
    if major != SUPPORTED_MAJOR:
        return [
            finding(
                "CK003",
                json_path("format_version"),
                f"format version {version} has major {major}; this reader understands major {SUPPORTED_MAJOR} only",
                "upgrade ckptspec, or migrate the manifest with `ckptspec migrate`",
            )
        ], True
    if minor > SUPPORTED_MINOR:
        return [
            finding(
                "CK004",
                json_path("format_version"),
                f"format version {version} is newer than {FORMAT_VERSION}; "
                "fields this reader does not know are kept unchecked",
                "upgrade ckptspec to check every field",
                severity="warning",
            )
        ], False
    return [], False


def line_version_findings(
    doc: dict, kind: str, supported: tuple[int, int], major_hint: str
) -> tuple[list[Finding], bool]:
    """``version_findings`` for a document kind with a version line of its own (``kind``: "checkpoint index", "DCP
    document"; ``supported``: the newest (major, minor) this reader knows); the same (findings, stop)."""
    version = doc.get("format_version")
    try:
        major, minor = (int(x) for x in str(version).split(".")[:2])
    except ValueError:
        return [], False  # the schema reports it
    if major != supported[0]:
        return [
            finding(
                "CK003",
                json_path("format_version"),
                f"{kind} version {version} has major {major}; this reader understands {supported[0]}",
                major_hint,
            )
        ], True
    if minor > supported[1]:
        return [
            finding(
                "CK004",
                json_path("format_version"),
                f"{kind} version {version} is newer than {supported[0]}.{supported[1]}",
                "upgrade ckptspec to check every field",
                severity="warning",
            )
        ], False
    return [], False

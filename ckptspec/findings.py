"""The one result type every check produces: a finding with a stable code."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem found in a manifest or checkpoint.

    ``path`` is a JSON path into the manifest (``$.groups[0].params[2].numel``);
    ``file`` and ``rank`` are set when the problem is in a shard file.
    """

    code: str
    rule: str
    path: str
    message: str
    hint: str
    severity: Severity = "error"
    file: str | None = None
    rank: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_line(self) -> str:
        where = self.path
        if self.file is not None:
            where = f"{self.file}: {where}" if where and where != "$" else self.file
        if self.rank is not None:
            where += f" (rank {self.rank})"
        label = self.code if self.severity == "error" else f"{self.code} warning:"
        return f"{where}: {label} {self.message} (hint: {self.hint})"


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def json_path(*parts: str | int) -> str:
    """Render ``("groups", 0, "numel")`` as ``$.groups[0].numel``."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            out += "[" + repr(part) + "]"
    return out

"""The one result type every check produces, and the one table of codes.

``CODES`` names every stable code ckptspec uses, findings and errors alike, in the
order and with the names of the ``## CKnnn name`` headings of docs/errors.md.
``RuleSet`` is the registry each family of checks uses (CK1xx manifest rules, CK2xx
checks of a checkpoint's files, CK5xx resume rules): one function per code, run in
registration order, named from ``CODES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Generic, Literal, TypeVar

Severity = Literal["error", "warning"]

CODES: dict[str, str] = {
    # CK0xx: format version and schema (format/validate.py)
    "CK001": "schema",
    "CK002": "model-disagreement",
    "CK003": "format-major",
    "CK004": "format-minor-newer",
    "CK005": "document-kind",
    # CK1xx: semantic rules of a manifest (format/rules.py)
    "CK101": "numel-shape",
    "CK102": "duplicate-name",
    "CK103": "alias-owner-missing",
    "CK104": "alias-chain",
    "CK105": "alias-shape",
    "CK106": "group-offsets",
    "CK107": "group-total",
    "CK108": "saved-numels",
    "CK109": "param-padding",
    "CK110": "group-alignment",
    "CK111": "partitioning-stage",
    "CK112": "partition-count",
    "CK113": "unsafe-path",
    "CK114": "duplicate-path",
    "CK115": "rank-range",
    "CK116": "locator-coverage",
    "CK117": "locator-numel",
    "CK118": "locator-member-bounds",
    "CK119": "locator-file-bounds",
    "CK120": "locator-target",
    "CK121": "tensor-coverage",
    "CK122": "tensor-locator-numel",
    "CK123": "model-weights-locator",
    "CK124": "state-coverage",
    "CK125": "state-numel",
    "CK126": "optimizer-groups",
    # CK2xx: a DeepSpeed checkpoint's directory and files (deepspeed/)
    "CK201": "no-tag",
    "CK202": "unsupported-checkpoint",
    "CK203": "no-model-states",
    "CK204": "unsafe-pickle",
    "CK205": "damaged-file",
    "CK206": "shard-missing",
    "CK207": "shard-unexpected",
    "CK208": "shard-size",
    "CK209": "shard-hash",
    "CK210": "shard-identity",
    "CK211": "optimizer-header",
    "CK212": "model-header",
    "CK213": "partition-numel",
    "CK214": "partition-locator",
    "CK215": "module-role",
    "CK216": "module-shape",
    "CK217": "module-layout",
    "CK218": "slice-mappings",
    "CK219": "alias-tie",
    "CK220": "frozen-fragments",
    "CK221": "tensor-locator",
    "CK222": "tensor-digest",
    "CK223": "other-save",
    "CK224": "leftover-temporary",
    "CK225": "pickle-over-cap",
    "CK226": "output-in-tag-directory",
    "CK227": "manifest-predates-embed",
    # CK23x: a model-parallel checkpoint's files against its index (deepspeed/check/cross_domain/)
    "CK230": "index-layer-file",
    "CK231": "index-degrees",
    "CK232": "index-other-save",
    "CK233": "index-module-shard",
    "CK234": "index-replica-differs",
    "CK235": "index-weights-not-masters",
    "CK236": "index-layer-file-gap",
    "CK237": "index-copy-differs",
    "CK240": "index-expert-file-missing",
    "CK241": "index-expert-file-other",
    "CK242": "index-partition-count",
    "CK243": "index-master-copy-differs",
    # CK25x: a torch DCP checkpoint's files against its .metadata (checkpoint/dcp/checks.py)
    "CK250": "dcp-chunk-coverage",
    "CK251": "dcp-storage-item",
    "CK252": "dcp-file-missing",
    "CK253": "dcp-item-bounds",
    "CK254": "dcp-item-record",
    # CK255-CK257: a torch DCP checkpoint's files against its document (checkpoint/dcp/against.py)
    "CK255": "dcp-document-other-save",
    "CK256": "dcp-file-differs",
    "CK257": "dcp-chunk-digest",
    # CK26x: a training run's tags (deepspeed/check/run.py: `ckptspec scan`, the validated resume)
    "CK260": "no-valid-tag",
    "CK261": "latest-not-newest-valid",
    # CK3xx: embedded copies and migrations (checkpoint/embedded.py, deepspeed/embed.py, format/migrate.py)
    "CK301": "embedded-copies-disagree",
    "CK302": "embedded-manifest-unreadable",
    "CK303": "no-embedded-manifest",
    "CK304": "manifest-mismatch",
    "CK305": "cannot-embed",
    "CK311": "no-migration",
    "CK312": "migration-failed",
    "CK313": "migration-dropped-field",
    # CK4xx: reconstruction (export/)
    "CK401": "reconstruct-mismatch",
    "CK402": "reconstruct-unsupported",
    "CK403": "kind-unsupported",
    "CK410": "reshard-unsupported",
    # CK5xx: resuming B from A (report/diff.py; across document kinds report/diff_kinds.py)
    "CK501": "resume-world-size",
    "CK502": "resume-zero-stage",
    "CK503": "resume-precision",
    "CK504": "resume-module-keys",
    "CK505": "resume-shape",
    "CK506": "resume-trainable-set",
    "CK507": "resume-group-layout",
    "CK508": "resume-parallel-degrees",
    "CK509": "resume-universal",
    "CK510": "resume-domains",
    # CK6xx: rules of a checkpoint index (format/index_rules.py)
    "CK602": "index-topology",
    "CK603": "index-domain-size",
    "CK604": "index-shared-file",
    "CK605": "index-shards-compose",
    "CK606": "index-shards-claimed",
    "CK607": "index-layer-files",
    "CK608": "index-placement-source",
    "CK609": "index-master-dtype",
    "CK610": "index-extras",
    # CK7xx: rules of a torch DCP document (format/dcp_rules.py)
    "CK701": "dcp-doc-chunk-coverage",
    "CK702": "dcp-doc-names",
    "CK703": "dcp-doc-item-place",
    "CK704": "dcp-doc-item-overlap",
    "CK705": "dcp-doc-world-size",
    # CK9xx: input and output (format/codec.py, the CLI)
    "CK901": "file-unreadable",
    "CK902": "file-too-large",
    "CK903": "not-decodable",
    "CK904": "duplicate-key",
    "CK905": "unknown-schema-version",
    "CK906": "write-failed",
    "CK907": "not-encodable",
    "CK908": "output-busy",
    "CK909": "foreign-output",
    # CK91x: remote locations (location.py)
    "CK910": "remote-not-found",
    "CK911": "remote-access-denied",
    "CK912": "remote-no-range",
    "CK913": "remote-changed",
    "CK914": "remote-timeout",
    "CK915": "remote-connection",
    "CK916": "remote-read-only",
    "CK917": "remote-backend",
    # CK918-CK919: a torchrun split (split.py)
    "CK918": "rank-failed",
    "CK919": "output-not-shared",
    # CK920: an output uploaded to a URL (location/upload.py)
    "CK920": "remote-upload-differs",
    "CK999": "internal-error",
}


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


def finding(
    code: str,
    path: str,
    message: str,
    hint: str,
    *,
    severity: Severity = "error",
    file: str | None = None,
    rank: int | None = None,
) -> Finding:
    """A finding of ``code``, named from ``CODES``."""
    return Finding(code, CODES[code], path, message, hint, severity, file, rank)


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


Check = TypeVar("Check", bound=Callable[..., Iterator[Finding]])


@dataclass(frozen=True)
class Rule(Generic[Check]):
    code: str
    name: str
    check: Check


class RuleSet(Generic[Check]):
    """Check functions of one family, one code each, in the order they run (registration order)."""

    def __init__(self, *parts: RuleSet[Check]) -> None:
        """An empty set, or the rules of ``parts`` one after the other."""
        self._rules: list[Rule[Check]] = [rule for part in parts for rule in part]

    def register(self, code: str) -> Callable[[Check], Check]:
        """Decorator: ``@RULES.register("CK101")``; the code must be in ``CODES``."""
        name = CODES[code]

        def add(fn: Check) -> Check:
            self._rules.append(Rule(code, name, fn))
            return fn

        return add

    def __iter__(self) -> Iterator[Rule[Check]]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

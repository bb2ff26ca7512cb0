"""A decision made once, on rank 0 of a group, and the same outcome on every rank: the verdict broadcast.

Rank 0 runs ``decide`` (a validation: it reads files) and broadcasts its *verdict*, plain data; every other
rank receives it instead of deciding again. When ``decide`` raises, the verdict is the error as data
(``failed``) and every rank raises it again (``raised``): its class, code, message, hint and findings, so
that no rank is left waiting in a collective and none goes on. Used by the validated resume
(``load_checkpoint``), the DCP reader (``export/dcp_reader.py``) and the training-framework integrations
(``same_on_every_rank``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ... import errors
from ...errors import CkptspecError
from ...findings import Finding

T = TypeVar("T")


def on_rank_0(
    decide: Callable[[], tuple[T, dict[str, Any]]], group: Any = None, what: str = ""
) -> tuple[T | None, dict]:
    """(``decide``'s value, its verdict) on rank 0 of ``group``; (None, the verdict rank 0 broadcast) on the others.
    An error of rank 0's, whatever it is, is raised on every rank (``what`` names the input in a foreign error)."""
    import torch.distributed as dist

    source = 0 if group is None else dist.get_global_rank(group, 0)
    if dist.get_rank(group) == 0:
        error: BaseException | None = None
        value: T | None = None
        try:
            value, verdict = decide()
        except Exception as exc:  # every rank must hear of it, whatever it is
            error, verdict = exc, failed(exc)
        dist.broadcast_object_list([verdict], src=source, group=group)
        if error is not None:
            raise error
        return value, verdict
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=source, group=group)
    if "error" in received[0]:
        raise raised(received[0]["error"], what)
    return None, received[0]


def failed(exc: BaseException) -> dict[str, Any]:
    """The verdict of a decision that raised: the error, as data every rank raises again."""
    if not isinstance(exc, CkptspecError):
        return {"error": {"class": None, "message": f"{type(exc).__name__}: {exc}"}}
    findings = getattr(exc, "findings", None)  # None: an error without findings; []: with none found
    found = None if findings is None else [f.to_dict() for f in findings]
    error = {"class": type(exc).__name__, "code": exc.code, "message": exc.message, "hint": exc.hint, "file": exc.file}
    return {"error": {**error, "findings": found}}


def raised(error: dict[str, Any], what: str) -> BaseException:
    """The error another process raised, of its class (a ckptspec error: its code, message, findings)."""
    cls = getattr(errors, error["class"] or "", None)
    if not (isinstance(cls, type) and issubclass(cls, CkptspecError)):
        return RuntimeError(f"the process that validated {what} failed: {error['message']}")
    exc = cls.__new__(cls)  # the classes' own constructors differ; every one is a CkptspecError underneath
    CkptspecError.__init__(exc, error["code"], error["message"], error["hint"], error["file"])
    if error["findings"] is not None:
        exc.findings = [Finding(**f) for f in error["findings"]]  # type: ignore[attr-defined]
    return exc


def same_on_every_rank(work: Callable[[], T], what: str = "") -> T:
    """``work()``'s value (plain data) on every rank, computed on rank 0; its error raised on every rank. Without a
    process group (one process), just ``work()``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return work()
    value, verdict = on_rank_0(lambda: (None, {"value": work()}), what=what)
    return verdict["value"]

"""A DCP bytes item's value, read without running it: plain values only.

``dcp.save`` writes every value of the state dict that is not a tensor (an optimizer's hyperparameters:
``optim.param_groups.0.lr``, ``betas``, ``params``...) as a ``BytesStorage`` item, a ``torch.save`` of the object,
and ``dcp.load`` reads it back with ``torch.load(..., weights_only=False)``: a forged item runs whatever its pickle
names. A real save's items name no global at all (numbers, strings, bools, None, tuples, lists, dicts). ``plain_value``
scans the pickle's opcodes (``pickle_scan``), then unpickles it with an allowlist of ``torch.Size`` (a tuple) and the
torch dtypes (their names) only: any other global is refused by name (``UnsafePickleError``, CK204) before anything
is called; a tensor inside the value (a persistent id) or a damaged pickle is a ``ValueError``. Standard library only.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from ...errors import UnsafePickleError
from ...format.dtypes import ITEMSIZE
from ...location import RemotePath
from ..pickle_scan import scan_pickle
from .standins import DTypeName, size

ALLOWED: dict[tuple[str, str], Any] = {("torch", "Size"): size, **{("torch", n): DTypeName(n) for n in ITEMSIZE}}


class _Unpickler(pickle.Unpickler):
    # find_class is the only way a pickle obtains a callable: REDUCE and NEWOBJ reach torch.Size's stand-in only.
    def __init__(self, data: bytes, path: Path | RemotePath, fqn: str):
        super().__init__(io.BytesIO(data))
        self._path, self._fqn = path, fqn

    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                self._path, f"bytes item {self._fqn} references global {module}.{name}, which is not allowlisted"
            ) from None

    def persistent_load(self, pid):
        raise ValueError("it holds a tensor (a persistent id): a bytes item of plain values never does")


def plain_value(data: bytes, path: Path | RemotePath, fqn: str) -> Any:
    """The value the bytes item ``fqn`` (of ``path``) pickles in ``data``; raises ``UnsafePickleError`` naming a
    global off the list, ``ValueError`` saying how the pickle is damaged."""
    try:
        scan_pickle(data)
    except ValueError as exc:  # a cut or malformed pickle, or one that would harm the unpickler: never run
        raise ValueError(f"its pickle is refused unread ({exc})") from None
    try:
        return _Unpickler(data, path, fqn).load()
    except (UnsafePickleError, ValueError):
        raise
    except RecursionError:
        raise ValueError("it nests too deep to read") from None
    except Exception as exc:  # any way the pickle is not torch.save's: damaged, never run
        raise ValueError(f"its pickle is damaged ({type(exc).__name__}: {exc})") from None

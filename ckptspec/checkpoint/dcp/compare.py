"""What ``ckptspec diff A B`` lists for two torch DCP directories: the entries added, removed, reshaped or retyped,
and those that hold other values (tensors by digest, ``digest``; bytes items by their plain values, ``checks``).

Both are checked first (the CLI reports errors as ``validate`` does). Each change is the row the DeepSpeed diff
writes (``kind``, ``path``: the entry's place in B's ``.metadata``, A's for what B lacks; ``a``, ``b``; ``name``;
``role``: ``tensor`` or ``bytes``), with one more kind: ``values``. Two Megatron-core torch_dist saves also have their
common states compared key by key (``role`` ``common``, ``path`` ``$.common[key]``; a value as ``megatron.describe``
gives it: a tensor in common.pt by dtype and shape, not its values). Standard library only.
"""

from __future__ import annotations

from typing import Any

from .checks import Where, bytes_values
from .digest import tensor_digest
from .megatron import describe
from .metadata import DcpMetadata, TensorEntry


def _change(kind: str, path: str, a: Any, b: Any, name: str, role: str | None = None) -> dict[str, Any]:
    """One row: ``report.diff.Change.to_dict``'s fields."""
    return {"kind": kind, "path": path, "a": a, "b": b, "name": name, **({"role": role} if role else {})}


def _role(entry) -> str:
    return "tensor" if isinstance(entry, TensorEntry) else "bytes"


def _where(fqn: str) -> str:
    return f"$.state_dict_metadata[{fqn!r}]"


def diff_dcp(a: Where, meta_a: DcpMetadata, b: Where, meta_b: DcpMetadata) -> list[dict[str, Any]]:
    """The changes from the checked DCP checkpoint ``a`` to ``b``, in B's entry order (then A's removed ones)."""
    out: list[dict[str, Any]] = []
    values_a: dict[str, Any] | None = None
    values_b: dict[str, Any] | None = None
    for fqn, eb in meta_b.entries.items():
        ea = meta_a.entries.get(fqn)
        if ea is None:
            out.append(_change("added", _where(fqn), None, _role(eb), fqn, _role(eb)))
        elif _role(ea) != _role(eb):
            out.append(_change("role", _where(fqn), _role(ea), _role(eb), fqn))
        elif isinstance(ea, TensorEntry) and isinstance(eb, TensorEntry):
            if ea.dtype != eb.dtype:
                out.append(_change("retyped", _where(fqn), ea.dtype, eb.dtype, fqn, "tensor"))
            elif ea.size != eb.size:
                out.append(_change("reshaped", _where(fqn), list(ea.size), list(eb.size), fqn, "tensor"))
            elif (da := tensor_digest(a, meta_a, fqn)) != (db := tensor_digest(b, meta_b, fqn)):
                out.append(_change("values", _where(fqn), da, db, fqn, "tensor"))
        else:
            values_a = bytes_values(a, meta_a) if values_a is None else values_a
            values_b = bytes_values(b, meta_b) if values_b is None else values_b
            va, vb = values_a.get(fqn), values_b.get(fqn)
            if (type(va), va) != (type(vb), vb):
                out.append(_change("values", _where(fqn), repr(va)[:200], repr(vb)[:200], fqn, "bytes"))
    for fqn, ea in meta_a.entries.items():
        if fqn not in meta_b.entries:
            out.append(_change("removed", _where(fqn), _role(ea), None, fqn, _role(ea)))
    return out + _common_changes(meta_a, meta_b)


def _common_changes(meta_a: DcpMetadata, meta_b: DcpMetadata) -> list[dict[str, Any]]:
    """Two Megatron saves' common states (common.pt), key by key: added, removed, values (B's order, then A's)."""
    if meta_a.megatron is None or meta_b.megatron is None:
        return []
    ca, cb = describe(meta_a.megatron.common or {}), describe(meta_b.megatron.common or {})
    out = []
    for key, vb in cb.items():
        where = f"$.common[{key!r}]"
        if key not in ca:
            out.append(_change("added", where, None, vb, key, "common"))
        elif ca[key] != vb:
            out.append(_change("values", where, ca[key], vb, key, "common"))
    out += [_change("removed", f"$.common[{k!r}]", va, None, k, "common") for k, va in ca.items() if k not in cb]
    return out

"""A DCP bytes item's value read by the restricted reader (no torch): plain values pass, with ``torch.Size`` and
dtypes; any other global is refused by name before anything is called; a persistent id (a tensor inside the value)
or a damaged pickle is a ``ValueError``. The real saves (and a forged one, beside torch's load) are tests/dcp's."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest

from ckptspec.checkpoint.dcp.values import plain_value
from ckptspec.errors import UnsafePickleError

HERE = Path("__0_0.distcp")


@pytest.mark.parametrize(
    "value",
    [0.01, 1e-08, True, None, "x", (0.9, 0.999), ["emb.weight", "l1.weight"], {"a": [1, (2, None)]}, 2**70],
)
def test_plain_values_pass(value):
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        got = plain_value(pickle.dumps(value, protocol=protocol), HERE, "optim.param_groups.0.lr")
        assert (type(got), got) == (type(value), value)


def test_a_torch_size_is_a_tuple_and_a_dtype_its_name():
    data = b"\x80\x02ctorch\nSize\n]q\x00(K\x02K\x03e\x85Rctorch\nbfloat16\n\x86."
    assert plain_value(data, HERE, "x") == ((2, 3), "bfloat16")


class _Payload:
    def __reduce__(self):
        return os.system, ("touch /nonexistent/never",)


def test_any_other_global_is_refused_by_name_before_it_runs():
    with pytest.raises(UnsafePickleError) as refused:
        plain_value(pickle.dumps({"lr": _Payload()}), HERE, "optim.param_groups.0.lr")
    assert refused.value.code == "CK204"
    assert refused.value.reason == (
        f"bytes item optim.param_groups.0.lr references global {os.system.__module__}.system, which is not allowlisted"
    )
    with pytest.raises(UnsafePickleError, match="global collections.OrderedDict"):
        plain_value(pickle.dumps(OrderedDict(a=1), protocol=2), HERE, "x")  # harmless, but no plain value: named


def test_a_persistent_id_or_damage_is_a_value_error():
    with pytest.raises(ValueError, match="holds a tensor"):
        plain_value(b"\x80\x02X\x01\x00\x00\x00aQ.", HERE, "x")
    with pytest.raises(ValueError, match="refused unread"):
        plain_value(pickle.dumps([1, 2, 3])[:-3], HERE, "x")
    with pytest.raises(ValueError):
        plain_value(b"\x80\x02ctorch\nSize\nX\x01\x00\x00\x00a\x85R.", HERE, "x")  # torch.Size("a")

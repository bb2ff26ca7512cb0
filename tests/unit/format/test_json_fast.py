"""The fast JSON writer (``format/json_fast.py``) writes the bytes the standard library writes.

Oracle: ``json.dumps(indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)`` (and the
compact form, ``separators=(",", ":")`` instead of the indent), on random
JSON-like data (floats, big ints, nulls, non-string keys, odd strings, lone surrogates) and on every
manifest of the conformance corpus. Real checkpoints: ``tests/deepspeed/test_generate_fast.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.format import json_fast
from ckptspec.format.codec import dumps, load_document

CORPUS = Path(__file__).resolve().parents[2] / "conformance"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.sampled_from([1e-05, 1e16, 1e22, 0.1, -0.0, 5e-324, 2**64 - 1, 2**64, -(2**63) - 1, "\ud800", "a: 1.5"])
)
keys = st.text() | st.integers(-5, 5) | st.sampled_from(["", "é", "\x00", "\ud800"])
documents = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=30
)


def _outcome(write, doc):
    try:
        return write(doc)
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        return type(exc)


def _reference(doc):
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _compact_reference(doc):
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, documents, max_size=6) | documents)
def test_same_bytes_or_same_refusal_as_the_standard_library(doc):
    # A non-string key can collide with a string one after conversion, and mixed keys cannot be
    # sorted: the standard library raises TypeError there, and so must the fast writer.
    assert _outcome(json_fast.dumps_indented, doc) == _outcome(_reference, doc)
    assert _outcome(json_fast.dumps_compact, doc) == _outcome(_compact_reference, doc)


def test_floats_nan_and_nulls_take_the_standard_library():
    doc = {"optimizer": {"lr": 1e-05, "big": 1e16, "betas": [0.9, 0.999]}, "groups": [{"n": 1}], "x": None}
    assert json_fast.dumps_indented(doc) == _reference(doc)
    assert json_fast.dumps_compact(doc) == _compact_reference(doc)
    for write in (json_fast.dumps_indented, json_fast.dumps_compact):
        with pytest.raises(ValueError):
            write({"a": [math.nan]})


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CORPUS.rglob("*.json") if "valid" in p.parts),
    ids=lambda p: p.relative_to(CORPUS).as_posix(),
)
def test_corpus_manifests_written_alike(path):
    doc = load_document(path)
    assert dumps(doc) == dumps(doc, reference=True) == _reference(doc)
    assert dumps(doc, compact=True) == dumps(doc, compact=True, reference=True) == _compact_reference(doc)


def _holds_float(value) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(map(_holds_float, value.values()))
    return isinstance(value, list) and any(map(_holds_float, value))


plain_documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.sampled_from(["1.5", "e12", "a.5,", "x]", "1e-5\n", " : 2.5 ", "[1.5]"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text() | st.sampled_from(["e", "1.5", "lr"]), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(plain_documents)
def test_every_float_is_seen_in_orjsons_text(doc):
    # A float orjson writes unlike the standard library (1e-05, 1e+16) would go unnoticed in the
    # bytes if the search missed it: the search itself is held to the document here (NaN and
    # infinities are null in orjson's text, which sends the value to the standard library anyway).
    if _holds_float(doc):
        assert json_fast.may_hold_float(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        assert json_fast.may_hold_float(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS), compact=True)

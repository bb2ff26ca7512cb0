"""The canonical JSON text of a manifest (``json.dumps(indent=2, sort_keys=True)``), written fast.

The standard library's encoder runs in pure Python as soon as ``indent`` is set: at 100k tensors
it cost more than reading the checkpoint. orjson (Rust) writes the same bytes for the data a
manifest's big sections hold (strings, ints, booleans, lists, maps with string keys), but not for
floats (``1e-05`` is ``1e-5`` there) nor NaN (``null`` there; the standard library refuses it). So
each top-level value is written by orjson, and written again by the standard library whenever
orjson refuses it or it may hold a float (``holds_no_float`` looks at its types; failing that, its
text is searched for a float's end or a null); the optimizer's hyperparameters
(floats) take the standard library, the params, files and locators orjson.
The compact text (``separators=(",", ":")``, the copy a save embeds in the model states) is written
the same way: there a number ends before a comma or a closing bracket instead of a newline.
``tests/unit/format/test_json_fast.py`` and ``benchmarks/check_identical.py`` compare the bytes.
"""

from __future__ import annotations

import json
import operator
import re
from itertools import chain, compress, repeat
from typing import Any

import orjson

# The end of a number with a fraction or an exponent: a number ends its line in orjson's indented
# output (a string ends in a quote), and literal newlines never occur inside a JSON string. A
# false alarm (a null or these bytes inside a string) only costs speed.
_FLOAT_END = re.compile(rb"[.eE][-+]?[0-9]+(?:,?\n|\Z)")
_COMPACT_FLOAT_END = re.compile(rb"[.eE][-+]?[0-9]+(?:[,\]}]|\Z)")
# Searched for in the text less what no number holds and no number ends at: the indentation,
# ":[]{}" and every letter but e and E (true, false, null, keys, names): 70% of a manifest's bytes.
# A number still ends where it did; no removal joins other bytes into one (a token ends its line,
# and a string keeps its quotes and backslashes).
_NOT_IN_NUMBERS = bytes(c for c in range(128) if (chr(c).isalpha() and c not in b"eE") or c in b" :[]{}")
_COMPACT_NOT_IN_NUMBERS = bytes(c for c in range(128) if chr(c).isalpha() and c not in b"eE")  # "]}" end numbers


def _reference(value: Any, compact: bool = False) -> bytes:
    if compact:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
    else:
        text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def dumps_reference(doc: Any, compact: bool = False) -> bytes:
    """What ``dumps_indented`` (or ``dumps_compact``) writes, by the standard library alone: the slow reference."""
    return _reference(doc, compact) if compact else _reference(doc) + b"\n"


def _value(value: Any, compact: bool = False) -> bytes:
    """``value`` as the standard library writes it at indent 0 (raises as it does)."""
    try:
        text = orjson.dumps(
            value, option=orjson.OPT_SORT_KEYS if compact else orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
        )
    except (TypeError, ValueError):  # big ints, non-str keys, surrogates, other types
        return _reference(value, compact)
    if holds_no_float(value):
        return text
    if b"null" in text or may_hold_float(text, compact):
        return _reference(value, compact)
    return text


_PLAIN = frozenset({str, int, bool, type(None)})
_IS = operator.is_


def holds_no_float(value: Any) -> bool:
    """True when ``value`` is plain JSON data (str, int, bool, None in lists, tuples and dicts) and
    holds no float: orjson's text of it is then the standard library's. Looks at the values' types,
    one nesting level at a time, in C loops: faster than searching the text for a float's end.
    False for anything else (dict keys are orjson's to refuse)."""
    level = [value]
    while level:
        kinds = set(map(type, level))
        if not kinds <= _PLAIN | {list, tuple, dict}:
            return False
        below: list[Any] = []
        for kind in (list, tuple, dict):
            if kind in kinds:
                of_kind = compress(level, map(_IS, map(type, level), repeat(kind)))
                below.extend(chain.from_iterable(map(dict.values, of_kind) if kind is dict else of_kind))
        level = below
    return True


def may_hold_float(text: bytes, compact: bool = False) -> bool:
    """orjson's (indented, or compact) text of a value might hold a float: True for every float."""
    floats, dropped = (_COMPACT_FLOAT_END, _COMPACT_NOT_IN_NUMBERS) if compact else (_FLOAT_END, _NOT_IN_NUMBERS)
    return floats.search(text.translate(None, dropped)) is not None


def dumps_indented(doc: Any) -> bytes:
    """Exactly ``(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\\n").encode()``,
    raising what it raises (``TypeError``, ``ValueError``, ``UnicodeEncodeError``)."""
    if not isinstance(doc, dict) or not doc or not all(type(k) is str for k in doc):
        return dumps_reference(doc)
    parts = []
    try:
        for key in sorted(doc):
            # One level down: every structural newline gains the two spaces of the enclosing map.
            parts += [b",\n  ", _reference(key), b": ", _value(doc[key]).replace(b"\n", b"\n  ")]
    except ValueError:
        # Raise what the whole document raises (a TypeError elsewhere wins over a lone surrogate here).
        return dumps_reference(doc)
    parts[0] = b"{\n  "
    # One join: at 1M tensors each copy of the text is 230 MB (concatenating pieces made four more).
    return b"".join([*parts, b"\n}\n"])


def dumps_compact(doc: Any) -> bytes:
    """Exactly ``json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=False,
    allow_nan=False).encode()``, raising what it raises."""
    if not isinstance(doc, dict) or not doc or not all(type(k) is str for k in doc):
        return dumps_reference(doc, compact=True)
    parts = []
    try:
        for key in sorted(doc):
            parts += [b",", _reference(key, compact=True), b":", _value(doc[key], compact=True)]
    except ValueError:
        return dumps_reference(doc, compact=True)  # as in dumps_indented: the whole document's error
    parts[0] = b"{"
    return b"".join([*parts, b"}"])

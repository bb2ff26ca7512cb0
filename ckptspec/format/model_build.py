"""The models of a schema-valid document, its params built in bulk.

``validate MANIFEST --checkpoint DIR``, ``reconstruct`` and the other readers of a manifest need its
Pydantic models. Validating them runs Python validators per param and per digest (seconds for a
100k-tensor manifest with format 1.1's digests), although the schema check has already accepted every value.
``manifest_of`` validates the document without its params, then makes each group's params as
``partition.make_params`` and ``construct.digests`` make them for a producer: by C loops where
every value plainly fits, else validated row by row. Only for a document from the loader (Unicode
strings, no float where an integer belongs) that the schema accepted and that has no fields of a
newer minor version; anything unusual about the params returns None and the caller validates the
whole document. ``tests/format/test_model_build.py`` holds it equal to ``Manifest.model_validate``.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import itemgetter
from typing import Any

from . import construct
from .models import Manifest
from .partition import PLAIN_FIELDS, make_params

_COLUMNS = ("name", "shape", "numel", "dtype", "offset", "padding")
_DIGESTS = frozenset({"digest", "model_digest", "state_digests"})


def manifest_of(doc: Any) -> Manifest | None:
    """``Manifest.model_validate(doc)`` for a schema-valid document from the loader; None when its
    params are not what this builds (then validate the document)."""
    groups = doc.get("groups") if type(doc) is dict else None
    if type(groups) is not list or not all(type(g) is dict and type(g.get("params")) is list for g in groups):
        return None
    made = [_params(group["params"]) for group in groups]
    if any(params is None for params in made):
        return None
    manifest = Manifest.model_validate({**doc, "groups": [{**group, "params": []} for group in groups]})
    for group, params in zip(manifest.groups, made):
        group.__dict__["params"] = params  # "params" is set (an empty list was validated in its place)
    return manifest


def _params(rows: list) -> list | None:
    """The ``Param`` of each row, or None when the rows differ in their keys, have keys other than a
    param's, or digests other than a sha256 alone."""
    if not rows:
        return []
    if not {dict}.issuperset(map(type, rows)):
        return None
    keys = rows[0].keys()
    if not (PLAIN_FIELDS <= keys <= PLAIN_FIELDS | _DIGESTS and all(map(keys.__eq__, map(dict.keys, rows)))):
        return None
    try:
        params = make_params(*(list(map(itemgetter(key), rows)) for key in _COLUMNS))
    except ValueError:  # a row the plain checks left to validation, which refused it: validate it all
        return None
    for field in keys - PLAIN_FIELDS:
        values = list(map(itemgetter(field), rows))
        made = _state_digests(values) if field == "state_digests" else _digests(values)
        if made is None:
            return None
        construct.set_fields(params, field, made)
    return params


def _digests(values: list) -> list | None:
    """A ``Digest`` of each ``{"sha256": hex}``; None for anything else (another algorithm, a null)."""
    if not (
        {dict}.issuperset(map(type, values))
        and set(map(len, values)) == {1}
        and all(map(dict.__contains__, values, repeat("sha256")))
    ):
        return None
    return construct.digests(list(map(itemgetter("sha256"), values)))


def _state_digests(values: list) -> list | None:
    """Each param's optimizer-state digests, a dict of ``Digest`` by state name; None as ``_digests``."""
    if not {dict}.issuperset(map(type, values)):
        return None
    made = _digests(list(chain.from_iterable(map(dict.values, values))))
    if made is None:
        return None
    out, at = [], 0
    for each in values:
        out.append(dict(zip(each, made[at : at + len(each)])))
        at += len(each)
    return out

"""``Manifest.to_dict``: the JSON-ready document, its params dumped by C loops where they are plain.

``model_dump(mode="json", exclude_unset=True, by_alias=True)`` costs pydantic a Python walk per param,
and a big manifest is nearly all params (1M tensors: 192 of its 229 MB of JSON). A
param as producers make it (``partition.make_params``) is a ``Param`` whose set fields are exactly
the six plain ones (no digest, no unknown field): what ``exclude_unset`` leaves of it is its
``__dict__`` less the unset fields, and its values (str, list of ints, ints: validated or checked
plainly fitting) are the same in ``mode="json"``. So each group's params are dumped as copies of
their ``__dict__`` (and of their shape), those unset keys deleted, all by C loops; any other list of params, and
everything else in the manifest, goes through pydantic as before.
``tests/format/test_manifest_dict.py`` holds this equal to ``model_dump``, key order included.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from .models import Group, Param
from .partition import PLAIN_FIELDS

if TYPE_CHECKING:
    from .models import Manifest

DUMP = {"mode": "json", "exclude_unset": True, "by_alias": True}
_UNSET = tuple(Param.model_fields.keys() - PLAIN_FIELDS)
_NO_ALIASES = all(f.alias is None and f.serialization_alias is None for f in Param.model_fields.values())
_FIELDS_SET, _EXTRA = attrgetter("__pydantic_fields_set__"), attrgetter("__pydantic_extra__")
_SHAPE = itemgetter("shape")
_BEFORE_PARAMS = frozenset(list(Group.model_fields)[: list(Group.model_fields).index("params")])
_params_adapter = None


def manifest_dict(manifest: Manifest) -> dict[str, Any]:
    """``manifest.model_dump(**DUMP)``, the same dict (keys in the same order)."""
    doc = manifest.model_dump(**DUMP, exclude={"groups": {"__all__": {"params"}}})
    for g, group in enumerate(manifest.groups):
        if "params" in group.model_fields_set:
            doc["groups"][g] = _with_params(doc["groups"][g], plain_params(group.params) or _dumped(group.params))
    return doc


def _with_params(entry: dict, params: list[dict]) -> dict:
    """``entry`` with ``params`` where ``model_dump`` puts it: after the fields defined before it."""
    items = list(entry.items())
    before = 0
    while before < len(items) and items[before][0] in _BEFORE_PARAMS:
        before += 1
    return {**dict(items[:before]), "params": params, **dict(items[before:])}


def plain_params(params: list) -> list[dict] | None:
    """``params`` dumped, when every one is a plain ``Param`` with exactly the plain fields set;
    else None (a digest, an unknown field, another type: pydantic dumps those)."""
    if not (
        params
        and _NO_ALIASES
        and {Param}.issuperset(map(type, params))
        and all(map(PLAIN_FIELDS.__eq__, map(_FIELDS_SET, params)))
        and not any(map(_EXTRA, params))
    ):
        return None
    dicts = list(map(dict.copy, map(vars, params)))
    for unset in _UNSET:
        deque(map(dict.__delitem__, dicts, repeat(unset)), 0)
    # A shape of its own, as model_dump gives: changing the document leaves the model as it was.
    deque(map(dict.__setitem__, dicts, repeat("shape"), map(list, map(_SHAPE, dicts))), 0)
    return dicts


def _dumped(params: list) -> list[dict]:
    global _params_adapter
    if _params_adapter is None:
        from pydantic import TypeAdapter

        _params_adapter = TypeAdapter(list[Param])
    return _params_adapter.dump_python(params, **DUMP)

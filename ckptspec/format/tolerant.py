"""The models of a newer minor format version: each model's twin that keeps unknown fields.

Format 1.x minors only add OPTIONAL fields, so a reader of 1.1 reads a 1.2 document by keeping
what it does not know (and dumping it back unchanged). ``tolerant(Manifest)`` is ``Manifest``'s
subclass with ``extra="allow"`` whose nested models are their own twins, derived from the fields
(one source of truth): the strict models stay strict, and neither has a Python validator per
object (a digest's "at least one algorithm" aside: ``models.TolerantDigest``).
"""

from __future__ import annotations

import copy
import types
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict

from .integral import integral_floats
from .models import Digest, TolerantDigest

M = TypeVar("M", bound=BaseModel)
_TWINS: dict[type, type] = {Digest: TolerantDigest}


def tolerant(cls: type[M]) -> type[M]:
    """``cls``'s twin for a newer minor's documents (made once, then cached)."""
    twin = _TWINS.get(cls)
    if twin is None:
        annotations: dict[str, Any] = {}
        namespace: dict[str, Any] = {"__module__": cls.__module__, "__doc__": cls.__doc__}
        for name, field in cls.model_fields.items():
            swapped = _twin_type(field.annotation)
            if swapped is not field.annotation:
                annotations[name] = swapped
                namespace[name] = copy.copy(field)
        namespace.update(__annotations__=annotations, model_config=ConfigDict(extra="allow"))
        twin = _TWINS[cls] = type(f"Tolerant{cls.__name__}", (cls,), namespace)
    return twin


def from_document(cls: type[M], doc: Any) -> M:
    """``doc`` (decoded data of any 1.x minor) as ``cls``'s twin: integral floats read as integers,
    unknown fields kept; raises ``pydantic.ValidationError`` as validation does."""
    return tolerant(cls).model_validate(integral_floats(doc, cls))


def _twin_type(tp: Any) -> Any:
    """``tp`` with every model in it replaced by its twin; ``tp`` itself when it holds none."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tolerant(tp)
    args = get_args(tp)
    origin = get_origin(tp)
    if not args or origin is Literal:
        return tp
    if origin is Annotated:
        inner = _twin_type(args[0])
        return tp if inner is args[0] else Annotated[(inner, *tp.__metadata__)]
    swapped = tuple(map(_twin_type, args))
    if all(a is b for a, b in zip(swapped, args)):
        return tp
    if origin in (Union, types.UnionType):
        return Union[swapped]  # noqa: UP007 (the members are computed)
    return origin[swapped]

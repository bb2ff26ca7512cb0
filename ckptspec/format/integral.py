"""Integral floats made integers, once, where a document is loaded.

JSON Schema counts ``3.0`` as an integer; the models are strict and take only ``3``. A loader
that found floats in a document (``codec.read_document`` tells) passes it through
``integral_floats`` before the models read it: where the models hold an integer, an integral
float becomes an int; a float where a number belongs (a learning rate) and a newer minor's
unknown fields stay as they are. Anything else is left for the models to refuse.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel


def integral_floats(value: Any, tp: Any) -> Any:
    """``value`` read as ``tp`` (a model class or a field's type) with its integral floats at
    integer places made ints: a copy where anything changed, ``value`` itself otherwise."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _model(value, tp) if type(value) is dict else value
    if tp is int:
        return int(value) if type(value) is float and value.is_integer() else value
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return integral_floats(value, args[0])
    if origin in (Union, types.UnionType):
        return _union(value, args)
    if origin is list and type(value) is list:
        return _changed(value, [integral_floats(v, args[0]) for v in value])
    if origin is tuple and type(value) is list:
        return _changed(value, [integral_floats(v, t) for v, t in zip(value, args)] + value[len(args) :])
    if origin is dict and type(value) is dict:
        made = {k: integral_floats(v, args[1]) for k, v in value.items()}
        return value if all(made[k] is v for k, v in value.items()) else made
    return value


def _model(value: dict, cls: type[BaseModel]) -> dict:
    fields = {f.alias or name: f for name, f in cls.model_fields.items()}
    made = {k: integral_floats(v, fields[k].annotation) if k in fields else v for k, v in value.items()}
    return value if all(made[k] is v for k, v in value.items()) else made


def _union(value: Any, args: tuple) -> Any:
    if float in args:  # a number: 3.0 stays a float
        return value
    if type(value) is dict:  # the model whose fields the object names
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel) and value.keys() & arg.model_fields.keys():
                return _model(value, arg)
        return value
    for arg in args:
        made = integral_floats(value, arg)
        if made is not value:
            return made
    return value


def _changed(value: list, made: list) -> list:
    return value if all(a is b for a, b in zip(made, value)) else made

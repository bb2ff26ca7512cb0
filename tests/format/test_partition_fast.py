"""``partition.make_param`` (a ``Param`` built without validation when its values plainly fit)
gives the object validation gives, and leaves anything else to validation."""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.format.models import Param
from ckptspec.format.partition import make_param

INT64_MAX = 2**63 - 1
ints = st.integers(-3, 5) | st.sampled_from([INT64_MAX, INT64_MAX + 1, -(2**63)]) | st.booleans() | st.just(3.0)
names = st.text(max_size=3) | st.sampled_from(["x" * 1024, "x" * 1025, "w.0"]) | st.integers(0, 2)
dtypes = st.sampled_from(["bfloat16", "float32", "bool", "float8_e5m2", "bf16", "", "Float32"])
shapes = st.lists(ints, max_size=3).map(tuple) | st.just((1,) * 64) | st.just((1,) * 65) | st.just([2, 3])


def _built(factory, *args):
    try:
        return factory(*args)
    except pydantic.ValidationError:
        return pydantic.ValidationError


def _validated(name, shape, numel, dtype, offset, padding):
    return Param(name=name, shape=list(shape), numel=numel, dtype=dtype, offset=offset, padding=padding)


@settings(max_examples=400, deadline=None)
@given(names, shapes, ints, dtypes, ints, ints)
def test_same_param_as_validation(name, shape, numel, dtype, offset, padding):
    fast = _built(make_param, name, shape, numel, dtype, offset, padding)
    slow = _built(_validated, name, shape, numel, dtype, offset, padding)
    if slow is pydantic.ValidationError:
        assert fast is pydantic.ValidationError
        return
    assert fast.model_dump() == slow.model_dump()
    assert fast.model_fields_set == slow.model_fields_set
    assert [type(v) for v in fast.shape] == [type(v) for v in slow.shape]
    assert type(fast.numel) is type(slow.numel) and type(fast.offset) is type(slow.offset)


def test_dumped_the_same():
    fast = make_param("w", (2, 3), 6, "bfloat16", 4, 2)
    slow = _validated("w", (2, 3), 6, "bfloat16", 4, 2)
    assert fast.model_dump(exclude_unset=True) == slow.model_dump(exclude_unset=True)


@pytest.mark.parametrize("bad", [("w", (2, -3), 6), ("", (2,), 2), ("w", (True,), 1), ("w", (2,), -1)])
def test_invalid_values_still_refused(bad):
    name, shape, numel = bad
    with pytest.raises(pydantic.ValidationError):
        make_param(name, shape, numel, "float32", 0, 0)

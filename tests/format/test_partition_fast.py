"""``partition.make_param`` (a ``Param`` built without validation when its values plainly fit)
gives the object validation gives, and leaves anything else to validation; ``make_params`` (the
same, for columns of values at once) gives what ``make_param`` gives row by row."""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.format.models import Param
from ckptspec.format.partition import ParamColumns, ParamSpec, flat_group, make_param, make_params, per_param_group

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


rows = st.lists(st.tuples(names, shapes, ints, dtypes, ints, ints), max_size=4)
plain_rows = st.lists(
    st.tuples(st.just("w.0"), st.just((2, 3)), st.just(6), st.just("bfloat16"), st.integers(0, 9), st.integers(0, 3)),
    max_size=4,
)


def _each(columns):
    try:
        return [make_param(*row) for row in zip(*columns)]
    except pydantic.ValidationError:
        return pydantic.ValidationError


def _bulk(columns):
    try:
        return make_params(*columns)
    except pydantic.ValidationError:
        return pydantic.ValidationError


@settings(max_examples=400, deadline=None)
@given(st.lists(rows | plain_rows, min_size=1, max_size=2).map(lambda parts: [r for p in parts for r in p]))
def test_bulk_same_params_as_one_by_one(table):
    columns = tuple(map(list, zip(*table))) if table else ([], [], [], [], [], [])
    bulk, each = _bulk(columns), _each(columns)
    if each is pydantic.ValidationError:
        assert bulk is pydantic.ValidationError
        return
    assert [p.model_dump() for p in bulk] == [p.model_dump() for p in each]
    assert [p.model_fields_set for p in bulk] == [p.model_fields_set for p in each]
    assert [[type(v) for v in p.shape] for p in bulk] == [[type(v) for v in p.shape] for p in each]


def test_bulk_params_do_not_share_state():
    a, b = make_params(["a", "b"], [(2,), (2,)], [2, 2], ["float32"] * 2, [0, 2], [0, 0])
    a.digest = None  # assigning a field adds to this object's fields set only
    assert a.model_fields_set != b.model_fields_set and a.shape is not b.shape


spec_rows = st.lists(
    st.tuples(st.sampled_from(["w", "b.0"]), st.lists(st.integers(0, 5), max_size=3).map(tuple), dtypes), max_size=5
)


@settings(max_examples=200, deadline=None)
@given(spec_rows, st.integers(1, 4), st.sampled_from([1, 2, 3]), st.booleans())
def test_groups_from_columns_are_those_from_specs(table, partition_count, zero_stage, paddings):
    """The group builders given a ``ParamSpec`` per param, or the same params as columns: one group."""
    specs = [ParamSpec(*row) for row in table]
    columns = ParamColumns(*(list(c) for c in zip(*table))) if table else ParamColumns([], [], [])
    pads = [i % 3 for i in range(len(table))] if paddings else None
    flat = dict(optimizer_group=1, partition_count=partition_count, zero_stage=zero_stage, paddings=pads)
    assert _dumped(lambda p: flat_group(p, **flat), columns) == _dumped(lambda p: flat_group(p, **flat), specs)
    per_param = dict(optimizer_group=0, partition_count=partition_count)
    assert _dumped(lambda p: per_param_group(p, **per_param), columns) == _dumped(
        lambda p: per_param_group(p, **per_param), specs
    )


def _dumped(build, params):
    try:
        return build(params).model_dump()
    except (pydantic.ValidationError, ValueError) as exc:
        return type(exc)

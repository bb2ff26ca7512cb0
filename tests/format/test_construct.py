"""``construct.build`` (a model built without validation when its values plainly fit) gives the
object validation gives, and leaves anything else to validation, for every model it builds."""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.format.construct import CHECKS, build
from ckptspec.format.models import FrozenParam, TensorLocator

INT64_MAX = 2**63 - 1
counts = st.integers(-2, 5) | st.sampled_from([INT64_MAX, INT64_MAX + 1]) | st.booleans() | st.just(2.0)
texts = st.text(max_size=3) | st.sampled_from(["x" * 256, "x" * 257, "x" * 1024, "x" * 1025, "x" * 4097]) | counts
shapes = st.lists(counts, max_size=3) | st.just([1] * 65) | st.just((2, 3)) | texts
choices = st.sampled_from(["float32", "bfloat16", "bf16", "module", "fragments", "partitioned_fragments", ""])
values = texts | counts | shapes | choices


def _built(factory, cls, row):
    try:
        return factory(cls, row)
    except pydantic.ValidationError:
        return pydantic.ValidationError


def _fast(cls, row):
    return build(cls, **row)


def _validated(cls, row):
    return cls(**row)


@pytest.mark.parametrize("cls", list(CHECKS), ids=lambda c: c.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_same_object_as_validation(cls, data):
    row = {key: data.draw(values, label=key) for key in CHECKS[cls]}
    fast, slow = _built(_fast, cls, row), _built(_validated, cls, row)
    if slow is pydantic.ValidationError:
        assert fast is pydantic.ValidationError
        return
    assert fast.model_dump() == slow.model_dump()
    assert fast.model_fields_set == slow.model_fields_set
    assert fast.model_dump_json(exclude_unset=True) == slow.model_dump_json(exclude_unset=True)


def test_a_plain_row_is_not_validated(monkeypatch):
    # The fast path really is taken for what producers give: validation would raise here.
    def refuse(*_a, **_k):
        raise AssertionError("validated")

    monkeypatch.setattr(FrozenParam, "__init__", refuse)
    made = build(FrozenParam, name="w", shape=[2, 3], numel=6, dtype="bfloat16", stored_in="module")
    assert made.model_dump(exclude_unset=True) == {
        "name": "w", "shape": [2, 3], "numel": 6, "dtype": "bfloat16", "stored_in": "module"
    }  # fmt: skip


@pytest.mark.parametrize(
    "row",
    [
        {"numel": -1},
        {"dtype": "bf16"},
        {"name": ""},
        {"data_offset": True},
        {"member": "x" * 4097},
        {"extra_field": 1},
    ],
)
def test_values_that_do_not_fit_are_still_refused(row):
    good = dict(name="w", member="archive/data/0", data_offset=0, member_size=8, dtype="float32", element_offset=0)
    with pytest.raises(pydantic.ValidationError):
        build(TensorLocator, **{**good, "numel": 2, **row})

"""``construct.build`` (a model built without validation when its values plainly fit) gives the
object validation gives, and leaves anything else to validation, for every model it builds;
``build_all`` (the same for columns of values at once) gives what ``build`` gives row by row; and
``digests`` gives the ``Digest`` objects validation gives."""

from __future__ import annotations

import hashlib

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.format.construct import CHECKS, build, build_all, digests
from ckptspec.format.models import Digest, FrozenParam, TensorLocator

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


def _objects(made) -> list:
    """What tells two built models apart: their fields (in order), fields set, extras and private."""
    return [(list(vars(m).items()), m.model_fields_set, m.__pydantic_extra__, m.__pydantic_private__) for m in made]


@pytest.mark.parametrize("cls", list(CHECKS), ids=lambda c: c.__name__)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_build_all_is_build_row_by_row(cls, data):
    rows = data.draw(st.integers(0, 4), label="rows")
    plain = data.draw(st.booleans(), label="plain")  # every value fitting: the bulk path
    columns = {
        key: [data.draw(_fitting(check) if plain else values) for _ in range(rows)]
        for key, check in CHECKS[cls].items()
    }
    try:
        row_by_row = [build(cls, **dict(zip(columns, row))) for row in zip(*columns.values())]
    except pydantic.ValidationError:
        with pytest.raises(pydantic.ValidationError):
            build_all(cls, columns)
        return
    assert _objects(build_all(cls, columns)) == _objects(row_by_row)


def _fitting(check):
    return st.sampled_from([v for v in (0, 7, [], [1, 2], "float32", "bfloat16", "x", "w.0", "module") if check(v)])


def test_plain_columns_are_not_validated(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("validated")

    monkeypatch.setattr(FrozenParam, "__init__", refuse)
    columns = {"name": ["w", "v"], "shape": [[2], []], "numel": [2, 1], "dtype": ["bfloat16"] * 2}
    made = build_all(FrozenParam, {**columns, "stored_in": ["fragments"] * 2})
    assert [m.model_dump(exclude_unset=True)["shape"] for m in made] == [[2], []]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.text(alphabet="0123456789abcdefABCDEF\u00e9x", min_size=63, max_size=65)
        | st.sampled_from(["ab" * 32, "0" * 64])
        | st.integers(),
        max_size=4,
    )
)
def test_digests_are_the_digests_validation_makes(hexes):
    try:
        slow = [Digest(sha256=h) for h in hexes]
    except pydantic.ValidationError:
        with pytest.raises(pydantic.ValidationError):
            digests(hexes)
        return
    fast = digests(hexes)
    assert [d.model_dump() for d in fast] == [d.model_dump() for d in slow]
    assert [d.model_fields_set for d in fast] == [d.model_fields_set for d in slow]
    assert [d.model_extra for d in fast] == [d.model_extra for d in slow]


def test_hashlibs_digests_are_not_validated(monkeypatch):
    monkeypatch.setattr(Digest, "__init__", lambda *_a, **_k: pytest.fail("validated"))
    made = digests([hashlib.sha256(b"x").hexdigest(), hashlib.sha256(b"").hexdigest()])
    assert [d.sha256 for d in made] == [hashlib.sha256(b"x").hexdigest(), hashlib.sha256(b"").hexdigest()]

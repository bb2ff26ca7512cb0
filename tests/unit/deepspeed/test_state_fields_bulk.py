"""The bulk readers of ``describe`` (a column of 1M shapes, dtypes or storages at once, by C loops
when every value is the plain kind) give what reading value by value gives, whatever the values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.checkpoint.states import StateCache
from ckptspec.checkpoint.torchfile import StorageRef, TensorRef
from ckptspec.deepspeed.describe import describe
from ckptspec.deepspeed.describe.locators import model_weights_locators, module_storages
from ckptspec.deepspeed.layout.state_fields import int_shape, int_shapes, module_dtypes
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir

SAVE = Path(__file__).resolve().parents[2] / "data" / "deepspeed-0.19.8" / "s2-bf16-ws2"  # a real DeepSpeed save


def _ref(dtype: str, key: str = "0") -> TensorRef:
    storage = StorageRef(member=f"m/data/{key}", key=key, dtype=dtype, itemsize=2, numel=4, location="cpu")
    return TensorRef(storage=storage, storage_offset=0, shape=(4,), stride=(1,))


dims = st.integers(0, 5) | st.booleans() | st.just(2.0)
shapes = st.lists(dims, max_size=3).map(tuple) | st.lists(dims, max_size=3)
entries = st.sampled_from(["bfloat16", "float32"]).map(_ref) | st.sampled_from([None, 3, "w", (4,)])


@settings(max_examples=300, deadline=None)
@given(st.lists(shapes, max_size=5))
def test_int_shapes_is_int_shape_of_each(values):
    assert int_shapes(values) == [int_shape(v) for v in values]
    assert all(type(s) is tuple and {int}.issuperset(map(type, s)) for s in int_shapes(values))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from("abcd"), entries), st.lists(st.sampled_from("abcde"), max_size=6))
def test_module_dtypes_and_storages_are_each_names_tensors(module, names):
    refs = [module.get(name) for name in names]
    tensors = [ref if isinstance(ref, TensorRef) else None for ref in refs]
    assert module_dtypes(module, "float16", names) == [t.storage.dtype if t else "float16" for t in tensors]
    assert module_storages(module, names) == [t.storage if t else None for t in tensors]


def _located(replace) -> list:
    """The model-weights locators of the committed save's model states, its module table changed by ``replace``."""
    manifest = describe(SAVE)
    path = resolve_tag_dir(SAVE) / "mp_rank_00_model_states.pt"
    states = StateCache()
    state = dict(states.state(path))
    state["module"] = replace(dict(state["module"]))
    return model_weights_locators(manifest, state, states.members(path))


def test_views_of_one_storage_are_located_as_one_whether_or_not_the_same_object():
    as_read = _located(lambda module: module)
    assert len(as_read) == 1 and as_read[0].numel > 0

    def equal_copies(module):  # equal storages, each its own object: one storage all the same
        return {
            k: dataclasses.replace(v, storage=dataclasses.replace(v.storage)) if isinstance(v, TensorRef) else v
            for k, v in module.items()
        }

    assert _located(equal_copies) == as_read


def test_a_group_whose_tensors_are_not_one_storage_is_not_located():
    manifest = describe(SAVE)
    names = [p.name for p in manifest.groups[0].params if p.numel]

    def one_missing(module):
        return {k: v for k, v in module.items() if k != names[-1]}

    def one_elsewhere(module):
        ref = module[names[-1]]
        return {**module, names[-1]: dataclasses.replace(ref, storage=dataclasses.replace(ref.storage, key="other"))}

    assert _located(one_missing) == []
    assert _located(one_elsewhere) == []

"""``check_tree`` counts flat containers (a state dict, its shapes, a module's ``_metadata``) in C,
without a frame each: the same verdict as walking them item by item, on any tree."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.checkpoint import pickle_scan
from ckptspec.checkpoint.pickle_scan import MAX_NESTING, check_tree
from ckptspec.checkpoint.standins import FragmentAddress, StorageRef, TensorRef

STORAGE = StorageRef("a/data/0", "0", "float32", 4, 64, "cpu")


def tensor(attrs: dict | None = None) -> TensorRef:
    return TensorRef(STORAGE, 0, (2, 3), (3, 1), attrs=attrs or {})


LEAVES = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.just(FragmentAddress(4, 0)),
    st.builds(tensor),
    st.builds(tensor, st.just({"ds_id": 1})),  # a tensor with attributes: never flat
)


def containers(children):
    def ordered(items):
        d = collections.OrderedDict(items)
        return d

    def with_attributes(items):
        d = collections.OrderedDict(items)
        d.__dict__["_metadata"] = collections.OrderedDict(k_v for k_v in items[:2])
        return d

    pairs = st.lists(st.tuples(st.text(max_size=3), children), max_size=5)
    return st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=4).map(tuple),
        pairs.map(dict),
        pairs.map(ordered),
        pairs.map(with_attributes),
        st.lists(st.tuples(st.integers(0, 3), children), max_size=3).map(dict),  # int keys
    )


TREES = st.recursive(LEAVES, containers, max_leaves=40)


def verdict(tree, max_nodes, flat: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not flat:
            m.setattr(pickle_scan, "_flat", lambda *_, **__: None)
        try:
            check_tree(tree, max_nodes)
        except ValueError as e:
            return str(e)
    return None


def smallest_cap(tree, flat: bool, monkeypatch):
    """The fewest nodes ``check_tree`` lets the tree have (its count), or what it refuses at any cap."""
    refused = verdict(tree, 10**6, flat, monkeypatch)
    if refused is not None:
        return refused
    low, high = 1, 10**6
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if verdict(tree, mid, flat, monkeypatch) is None else (mid + 1, high)
    return low


def deep(levels: int):
    tree = []
    for _ in range(levels):
        tree = [tree]
    return tree


@settings(max_examples=400, deadline=None)
@given(tree=TREES, share=st.booleans(), cap=st.integers(1, 100), then_deep=st.booleans())
def test_flat_containers_are_counted_as_walked(tree, share, cap, then_deep):
    monkeypatch = pytest.MonkeyPatch()
    if share:  # one object in several places counts once per place
        tree = [tree, tree, {"x": tree}]
    if then_deep:  # a sibling too deep after it: which refusal comes first must not change
        tree = [tree, deep(MAX_NESTING)]
    assert smallest_cap(tree, True, monkeypatch) == smallest_cap(tree, False, monkeypatch)
    assert verdict(tree, cap, True, monkeypatch) == verdict(tree, cap, False, monkeypatch)


def test_the_shortcut_is_taken_and_counts_what_a_walk_counts(monkeypatch):
    shapes = collections.OrderedDict((f"p{i}", (i, 2)) for i in range(1000))
    metadata = collections.OrderedDict((f"m{i}", {"version": 1}) for i in range(1000))
    tensors = collections.OrderedDict((f"w{i}", tensor()) for i in range(1000))
    for container, nodes, height in ((shapes, 1 + 2000 + 2000, 2), (metadata, 1 + 2000 + 2000, 2), (tensors, 2001, 1)):
        assert pickle_scan._flat(container) == (nodes, height)
        for cap in (nodes + 1, nodes, nodes - 1):  # the list holding it makes nodes + 1
            found = verdict([container], cap, True, monkeypatch)
            assert found == verdict([container], cap, False, monkeypatch)
            assert (found is None) == (cap == nodes + 1), (cap, found)


def test_depth_at_a_flat_container_is_exact(monkeypatch):
    """A flat container of shapes is two levels: at the limit it reads, one deeper it is refused."""
    for depth_ok in (True, False):
        tree = {"p": (1, 2)}
        for _ in range(MAX_NESTING - 2 + (0 if depth_ok else 1)):
            tree = [tree]
        found = verdict(tree, 10**6, True, monkeypatch)
        assert found == verdict(tree, 10**6, False, monkeypatch)
        assert (found is None) == depth_ok, found

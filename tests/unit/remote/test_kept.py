"""The bytes a command keeps (``location/kept.py``): whatever is kept is found again by any range
that touches it, within the budget (review of #37: a short span kept inside a long one hid the
long one from ``overlapping``; a span that replaced a path's only span was kept where nothing
found it, and its eviction raised KeyError)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptspec.location.kept import Kept

DATA = bytes(range(256)) * 40
SPANS = st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 1500)), min_size=1, max_size=30)


@given(SPANS)
def test_every_kept_byte_is_found_and_is_the_byte_kept(spans):
    kept = Kept(3000)
    for start, size in spans:
        kept.keep("f", start, DATA[start : start + size])
    held = kept._by_path.get("f", [])
    assert kept._size == sum(len(d) for _, d in held) <= 3000
    for start, data in held:
        for at in (start, start + len(data) // 2, start + len(data) - 1):
            found = kept.overlapping("f", at, at + 1)
            assert any(s <= at < s + len(d) and d[at - s] == DATA[at] for s, d in found), (at, held)


def test_a_short_span_inside_a_long_one_does_not_hide_it():
    kept = Kept(10**6)
    kept.keep("f", 0, DATA[:1000])
    kept.keep("f", 10, DATA[10:15])
    assert [s for s, _ in kept.overlapping("f", 500, 600)] == [0]
    kept = Kept(10**6)
    kept.keep("f", 10, DATA[10:15])
    kept.keep("f", 0, DATA[:1000])
    assert [s for s, _ in kept.overlapping("f", 500, 600)] == [0]

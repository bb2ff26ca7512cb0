"""The scan's fast lanes (``torch_records``: a record at a time, and runs of records taken
together) leave the walk exactly where the walk would be: on ``torch.save``'s own pickles, and on
those pickles with their records broken in every way the lanes must hand back (a memo index past
the end, a read of the record's own write, a tuple read from the memo, a read of an index never
written, a name whose length lies), the same memo, stack and marks, or the same refusal."""

from __future__ import annotations

import collections
import dataclasses
import io
import pickletools
import struct
import zipfile
from itertools import repeat

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.checkpoint import pickle_scan, torch_records
from ckptspec.checkpoint.pickle_scan import MAX_NESTING


def _data_pkl(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


@dataclasses.dataclass
class FragmentAddress:  # pickled as DeepSpeed's fragment_address: NEWOBJ, then its attributes by BUILD
    numel: int
    start: int


def _deepspeed_like() -> bytes:
    """A model-states pickle as DeepSpeed saves one: a state dict of views of flat buffers (shared
    storages, as ZeRO's) and of tensors of their own, with a module's ``_metadata``, then every
    parameter's ``torch.Size``, tensors each with a storage of its own (frozen parameters' fragments);
    and, as in the optimizer states, every parameter's fragment address."""
    flat = torch.zeros(100_000)
    shapes = [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 1, 2), (1,), (0,), (4, 0)]
    module, param_shapes, mappings = collections.OrderedDict(), collections.OrderedDict(), collections.OrderedDict()
    offset = 0
    for i in range(320):
        shape = shapes[i % len(shapes)]
        numel = torch.Size(shape).numel()
        if i % 3:
            module[f"layers.{i}.weight"] = flat[offset : offset + numel].view(shape)
            offset += numel
        else:
            module[f"layers.{i}.weight"] = torch.ones(shape, dtype=torch.bfloat16, requires_grad=i % 2 == 0)
        param_shapes[f"layers.{i}.weight"] = torch.Size(shape)
        mappings[f"layers.{i}.weight"] = FragmentAddress(numel, offset)
    module["layers.0.t"] = torch.zeros(3, 4).t()  # a stride that is not the size's
    for i in range(40):  # views back to back: a run of records naming a storage named before
        module[f"layers.{i}.view"] = flat[i : i + 6].view(2, 3)
    module._metadata = collections.OrderedDict((f"layers.{i}", {"version": 1}) for i in range(200))
    own = collections.OrderedDict((f"layers.{i}.frozen", torch.full((i % 5 + 1, 2), float(i))) for i in range(60))
    return _data_pkl(
        {
            "module": module,
            "param_shapes": [param_shapes],
            "frozen_param_fragments": own,
            "param_slice_mappings": [mappings],
            "ds_version": "0.19.8",
        }
    )


def _with_deep_tuple(data: bytes, depth: int) -> tuple[bytes, int]:
    """``data`` with a tuple ``depth`` deep memoized (then popped) after PROTO, at an index the
    pickle does not use; returns the pickle and that index."""
    assert data[:2] == b"\x80\x02"
    index = len(data) - 1  # below the new length: a put the walk allows
    prefix = b")" + b"\x85" * (depth - 1) + b"r" + struct.pack("<I", index) + b"0"
    return data[:2] + prefix + data[2:], index


def _outcome(data: bytes, fast: bool):
    try:
        return pickle_scan.walk(data, fast)
    except ValueError as error:
        return str(error)


def _taken(data: bytes) -> list[tuple[int, int]]:
    """The spans the lanes take when they walk ``data``: a record, and the run after it."""
    spans, real = [], torch_records.named_record

    def spy(data, pos, n, memo, stack):
        end = real(data, pos, n, memo, stack)
        if end:
            spans.append((pos, end))
        return end

    torch_records.named_record = spy
    try:
        pickle_scan.walk(data, fast=True)
    finally:
        torch_records.named_record = real
    return spans


def _within(position: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= position < end for start, end in spans)


BASE, DEEP_INDEX = _with_deep_tuple(_deepspeed_like(), MAX_NESTING)
# Where each name ends (its record's start), and where its BINUNICODE starts.
NAMES = {pos + 5 + len(arg): pos for op, arg, pos in pickletools.genops(BASE) if str(arg).startswith("layers.")}
# Every record after a name memoized with LONG_BINPUT and followed by a memo read (the records
# after the first 256 memo entries, bar the first Size, whose class comes by GLOBAL), and every
# module's _metadata entry.
RECORDS = [
    torch_records._NAMED_RECORD(BASE, end) for end in NAMES if BASE[end] == 0x72 and BASE[end + 5] in (0x68, 0x6A)
]
METADATA = [m for m in map(torch_records.METADATA.record, repeat(BASE), NAMES) if m]


def _kind(match) -> str:
    if match.re is not torch_records._NAMED_RECORD.__self__:
        return "_metadata entry"
    if match.group(3):
        return "tensor, new storage" if match.group(6) else "tensor"
    return "shape" if match.lastindex <= 17 else "object"


def test_the_lanes_take_every_record_and_end_where_the_walk_ends():
    assert all(RECORDS)
    spans = _taken(BASE)
    assert all(_within(m.start(), spans) for m in RECORDS + METADATA)
    kinds = collections.Counter("tensor" if m.group(3) else "shape" if m.lastindex <= 17 else "object" for m in RECORDS)
    assert min(kinds["tensor"], kinds["shape"], kinds["object"]) > 250, kinds  # scalars and new keys among them
    assert len(METADATA) == 199  # every entry but the first, which writes "version" out
    # Runs of every kind were taken together: a record's name inside a lane's span.
    in_runs = collections.Counter(_kind(m) for m in RECORDS + METADATA if _within(NAMES[m.start()], spans))
    assert len(in_runs) == 5 and min(in_runs.values()) >= 30, in_runs
    fast = pickle_scan.walk(BASE, fast=True)
    assert fast == pickle_scan.walk(BASE, fast=False)
    assert fast[0][DEEP_INDEX] == MAX_NESTING  # the walk counted the prefix: the depths are real


def _fields(match) -> list[tuple[int, int, str]]:
    """(start, end, kind) of every memo index in a record: a put's 4-byte argument, a read's whole
    token (BINGET or LONG_BINGET)."""
    found = []
    for group in range(1, match.re.groups + 1):
        start, end = match.span(group)
        if start < 0:
            continue
        if end - start == 4 and match.string[start - 1] == 0x72:  # LONG_BINPUT's argument
            found.append((start, end, "put"))
        elif match.string[start] in (0x68, 0x6A):
            found.append((start, end, "read"))
    return found


def _set_index(data: bytes, field: tuple[int, int, str], index: int, short: bool = True) -> bytes:
    """``data`` with the memo index of ``field`` set to ``index`` (a read as BINGET if it fits and
    ``short``, else LONG_BINGET: the record may change length)."""
    start, end, kind = field
    if kind == "put":
        raw = struct.pack("<I", min(index, 2**32 - 1))
    else:
        raw = b"h" + bytes([index]) if index < 256 and short else b"j" + struct.pack("<I", min(index, 2**32 - 1))
    return data[:start] + raw + data[end:]


# One example per way a record goes back to the walk, each in the first record the lane takes,
# and in a record in the middle of a run (taken with the records around it).
FIRST = RECORDS[0]
NAME_PUT, STORAGE_READ = _fields(FIRST)[0], _fields(FIRST)[2]
OWN_PUT = struct.unpack_from("<I", BASE, _fields(FIRST)[-1][0])[0]  # the tensor's own put
_SPANS = _taken(BASE)  # once: each walk takes a few seconds, and collection runs this module in every worker
_IN_RUNS = [k for k, m in enumerate(RECORDS) if m.group(3) and _within(NAMES[m.start()], _SPANS)]
MIDDLE, BEFORE = RECORDS[_IN_RUNS[10]], RECORDS[_IN_RUNS[10] - 1]  # a tensor's, inside a run
MIDDLE_PUT, MIDDLE_READ = _fields(MIDDLE)[0], _fields(MIDDLE)[2]
EARLIER_PUT = struct.unpack_from("<I", BASE, _fields(BEFORE)[-1][0])[0]  # the record before's last put


def _lying_length(record, by: int) -> bytes:
    """``BASE`` with the length of ``record``'s name off by ``by`` (its bytes unchanged)."""
    at = NAMES[record.start()] + 1
    length = struct.unpack_from("<I", BASE, at)[0]
    return BASE[:at] + struct.pack("<I", length + by) + BASE[at + 4 :]


@pytest.mark.parametrize(
    "case, data",
    [
        ("a put past the end", _set_index(BASE, NAME_PUT, len(BASE))),
        ("a put at the last index", _set_index(BASE, NAME_PUT, len(BASE) - 1)),
        ("a read of the deep tuple", _set_index(BASE, STORAGE_READ, DEEP_INDEX)),
        ("a read of the record's own write", _set_index(BASE, STORAGE_READ, OWN_PUT)),
        ("a read of an index never written", _set_index(BASE, STORAGE_READ, len(BASE) - 2)),
        ("cut inside a record", BASE[: FIRST.end() - 3]),
        ("mid-run: a put past the end", _set_index(BASE, MIDDLE_PUT, len(BASE))),
        ("mid-run: a put going back", _set_index(BASE, MIDDLE_PUT, EARLIER_PUT)),
        ("mid-run: a read of the deep tuple", _set_index(BASE, MIDDLE_READ, DEEP_INDEX)),
        ("mid-run: a read of an index never written", _set_index(BASE, MIDDLE_READ, len(BASE) - 2)),
        ("mid-run: a name longer than it says", _lying_length(MIDDLE, -1)),
        ("mid-run: a name shorter than it says", _lying_length(MIDDLE, 1)),
        ("mid-run: a _metadata name shorter than it says", _lying_length(METADATA[50], 1)),
        ("cut inside a run", BASE[: MIDDLE.end() - 3]),
    ],
)
def test_each_way_back_to_the_walk(case, data):
    fast, walked = _outcome(data, fast=True), _outcome(data, fast=False)
    assert fast == walked
    if "past the end" in case or "deep tuple" in case or "never written" in case or "cut" in case:
        assert isinstance(walked, str)  # refused, by both


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_broken_records_are_judged_as_the_walk_judges_them(data):
    """Memo indices in the records the lanes take, set to what each rule is about (past the end,
    an index this record or an earlier one writes, the deep tuple, an index never written, any),
    or a byte of a record or of its name (the opcode, the length, the text) set to anything; one
    to three changes."""
    pickle = BASE
    for _ in range(data.draw(st.integers(1, 3))):
        record = data.draw(st.sampled_from(RECORDS + METADATA))
        fields = _fields(record)
        if data.draw(st.booleans()):
            written = [struct.unpack_from("<I", BASE, start)[0] for start, _, kind in fields if kind == "put"]
            index = data.draw(
                st.sampled_from([0, 2, 255, 256, len(BASE), len(BASE) + 7, 2**32 - 1, DEEP_INDEX, *written])
                | st.integers(0, 2**32 - 1)
            )
            shift = len(pickle) - len(BASE)  # earlier changes may have moved this record
            start, end, kind = data.draw(st.sampled_from(fields))
            if pickle[start + shift : end + shift] == BASE[start:end]:
                pickle = _set_index(pickle, (start + shift, end + shift, kind), index, data.draw(st.booleans()))
        else:
            offset = data.draw(st.integers(NAMES[record.start()], record.end() - 1))
            pickle = pickle[:offset] + bytes([data.draw(st.integers(0, 255))]) + pickle[offset + 1 :]
    assert _outcome(pickle, fast=True) == _outcome(pickle, fast=False)

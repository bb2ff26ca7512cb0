"""The fast lanes of ``scan_pickle``: the records ``torch.save`` writes by the hundred thousand,
recognised whole, one at a time and then in runs.

A state dict entry (a name, then the call that rebuilds a tensor) is 28 opcodes; a named
``torch.Size`` (DeepSpeed's ``param_shapes``) 9; a named fragment address (its
``param_slice_mappings``) 16: walked one opcode at a time, they are most of what the scan of a
100k-tensor checkpoint costs. Here one regular expression matches a record byte for byte: every
opcode's first byte fixes how long it is, so a match is the opcode walk itself. The record's
effect on the memo and the stack is then applied in one go: the values ``scan_pickle`` would
have stored, in its order. Whatever the walk could refuse or read differently (a memo index past
the end, a read of an index the record itself writes, a tuple read from the memo) sends the
record back to it untouched, so the verdicts and their messages are the walk's by construction;
``tests/checkpoint/test_torch_records.py`` compares both.
"""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Iterable
from itertools import chain, islice, repeat
from operator import itemgetter

_U32 = struct.Struct("<I").unpack
_INT = rb"(?:K.|M..|J....)"  # BININT1, BININT2, BININT: push a plain value
_GET = rb"(h.|j....)"  # BINGET, LONG_BINGET
_PUT = rb"r(....)"  # LONG_BINPUT (BINPUT only serves a pickle's first 256 values)
# A tuple of ints (a size, a stride), depth 1: EMPTY_TUPLE, never memoized (pickle shares the one
# empty tuple), or TUPLE1-3 or MARK ... TUPLE, then memoized.
_SHAPE = rb"(?:\)|(?:%s\x85|%s{2}\x86|%s{3}\x87|\(%s*t)%s)" % ((_INT,) * 4 + (_PUT,))
# A storage key the first time it appears: BINUNICODE of a decimal of 1 to 9 digits, memoized.
_NEW_KEY = b"X(?:%s)" % b"|".join(re.escape(struct.pack("<I", k)) + b"." * k for k in range(1, 10)) + _PUT

# After a name's BINUNICODE, the name memoized and a callable read from the memo, one of
# - a state dict entry: ((storage, class, key, device, numel) BINPERSID, offset, size, stride,
#   requires_grad, OrderedDict()) REDUCE, the call of _rebuild_tensor_v2 (groups 3-14);
# - a named shape: (size,) REDUCE, the call of torch.Size (groups 15-17);
# - a named object of two attributes: () NEWOBJ, {attr: int, attr: int} BUILD, how a dataclass
#   pickles (DeepSpeed's fragment_address in param_slice_mappings; groups 18-21).
_NAMED_RECORD = re.compile(
    _PUT + _GET + rb"(?:"
    + rb"\(\(" + _GET + _GET + rb"(?:" + _GET + b"|" + _NEW_KEY + b")" + _GET
    + _INT + b"t" + _PUT + b"Q" + _INT + _SHAPE + _SHAPE
    + rb"[\x88\x89]" + _GET + rb"\)R" + _PUT + b"t" + _PUT + b"R" + _PUT
    + b"|" + _SHAPE + rb"\x85" + _PUT + b"R" + _PUT
    + b"|" + rb"\)\x81" + _PUT + b"}" + _PUT + rb"\(" + _GET + _INT + _GET + _INT + b"ub"
    + b")",
    re.DOTALL,
).match  # fmt: skip
_TENSOR_PUTS, _SHAPE_PUTS, _THREE_PUTS = (struct.Struct(f"<{k}I").unpack for k in (7, 4, 3))
# What the walk stores at each put of a state dict entry, in order: the name, the key (a new
# one), the persistent id (a tuple of plain values), the size, the stride, OrderedDict(), the
# arguments (a tuple holding tuples), the tensor (a call's result). Of a named shape: the name,
# the size, (size,), the Size.
_TENSOR_VALUES = (0, 0, 1, 1, 1, 1, 2, 1)
_SHAPE_VALUES = (0, 1, 2, 1)

_reads: dict[bytes, tuple] = {}  # a record's BINGET/LONG_BINGET tokens -> what _read_plan makes of them
_MAX_CACHED = 4096  # distinct token runs: a checkpoint has a handful (the same classes, strings)


def _index(token: bytes) -> int:
    """The memo index a BINGET (``h`` and one byte) or LONG_BINGET (``j`` and four) reads."""
    return token[1] if len(token) == 2 else _U32(token[1:])[0]


def _read_plan(tokens: bytes) -> tuple:
    """(first index, a getter of the middle ones, last index, the largest index) for the memo reads
    a record's tokens make, decoded once per distinct run of tokens."""
    plan = _reads.get(tokens)
    if plan is None:
        found, i = [], 0
        while i < len(tokens):
            width = 2 if tokens[i] == 0x68 else 5
            found.append(_index(tokens[i : i + width]))
            i += width
        plan = (found[0], itemgetter(*found[1:-1]), found[-1], max(found))
        if len(_reads) < _MAX_CACHED:
            _reads[tokens] = plan
    return plan


def named_record(data: bytes, pos: int, n: int, memo: dict, stack: list) -> int:
    """At ``pos``, just after a BINUNICODE pushed a name: if a state dict entry or a named shape
    follows and the walk would take it without a doubt, apply its effect and return the position
    after it; else 0, with nothing changed. A KeyError is the walk's own: a memo read of an index
    never written, the first such read in the walk's order."""
    m = _NAMED_RECORD(data, pos)
    if m is None:
        return take_run(METADATA, data, pos, n, memo, stack, unnamed=True)
    name, fn, storage, cls, key, new_key, device, persid, size, stride, od_fn, od, args, result = m.groups()[:14]
    if storage is None:
        return _named_shape(m, n, memo, stack) if (m.lastindex or 0) <= 17 else _named_object(m, n, memo, stack)
    if new_key is not None or size is None or stride is None:
        return _uncommon_entry(m, n, memo, stack)
    a, b, c, d, e, f, g = _TENSOR_PUTS(name + persid + size + stride + od + args + result)
    first, middle, last, top = _read_plan(fn + storage + cls + key + device + od_fn)
    # Left to the walk: an index past the end (refused there), an index at or below a read's (the
    # read could be of this record's own write; torch.save reads only what came before).
    if not (
        top < a < n and top < b < n and top < c < n and top < d < n and top < e < n and top < f < n and top < g < n
    ):
        return 0
    # The walk's reads up to the persistent id, in its order: its items must hold no tuple.
    memo[first]
    if any(middle(memo)):
        return 0
    memo[last]  # OrderedDict, read after the persistent id
    memo[a], memo[b], memo[c], memo[d], memo[e], memo[f], memo[g] = 0, 1, 1, 1, 1, 2, 1
    stack.append(1)  # the tensor: a call's result
    return take_run(TENSOR, data, m.end(), n, memo, stack) or m.end()


def _uncommon_entry(m, n, memo, stack) -> int:
    """named_record for a state dict entry with a new storage key or a shape of no dimensions."""
    name, fn, storage, cls, key, new_key, device, persid, size, stride, od_fn, od, args, result = m.groups()[:14]
    present = [(p, v) for p, v in zip((name, new_key, persid, size, stride, od, args, result), _TENSOR_VALUES) if p]
    puts = [_U32(p)[0] for p, _ in present]
    first, middle, last, top = _read_plan(fn + storage + cls + (key or b"") + device + od_fn)
    if max(puts) >= n or top >= min(puts):
        return 0
    memo[first]
    if any(middle(memo)):
        return 0
    memo[last]
    memo.update(zip(puts, (v for _, v in present)))  # in order: of two puts at one index, the later stays
    stack.append(1)
    if new_key is not None and size is not None and stride is not None:
        return take_run(TENSOR_NEW_KEY, m.string, m.end(), n, memo, stack) or m.end()
    return m.end()


def _named_shape(m, n, memo, stack) -> int:
    name, fn = m.group(1, 2)
    shape, args, result = m.groups()[14:17]
    fn = fn[1] if len(fn) == 2 else _U32(fn[1:])[0]
    if shape is not None:
        a, b, c, d = _SHAPE_PUTS(name + shape + args + result)
        if not (fn < a < n and fn < b < n and fn < c < n and fn < d < n):  # as in named_record
            return 0
        memo[fn]  # the callable: the one read
        memo[a], memo[b], memo[c], memo[d] = _SHAPE_VALUES
        stack.append(1)  # the call's result
        return take_run(SHAPE, m.string, m.end(), n, memo, stack) or m.end()
    else:  # torch.Size(()): the empty tuple is not memoized
        a, c, d = _THREE_PUTS(name + args + result)
        if not (fn < a < n and fn < c < n and fn < d < n):
            return 0
        memo[fn]
        memo[a], memo[c], memo[d] = 0, 2, 1
    stack.append(1)  # the call's result
    return m.end()


def _named_object(m, n, memo, stack) -> int:
    name, fn = m.group(1, 2)
    obj, attrs, first_key, second_key = m.groups()[17:]
    a, b, c = _THREE_PUTS(name + obj + attrs)
    cls, keys, last, top = _read_plan(fn + first_key + second_key)
    if not (top < a < n and top < b < n and top < c < n):  # as in named_record
        return 0
    memo[cls], keys(memo), memo[last]  # the class and the attribute names: only read
    memo[a], memo[b], memo[c] = 0, 1, 0  # the name, the object (a call's result), its attributes
    stack.append(1)
    return take_run(OBJECT, m.string, m.end(), n, memo, stack) or m.end()


# --- Runs of records taken together ------------------------------------------------------------
#
# ``torch.save`` writes a big dict in batches of up to 1000 items between a MARK and a SETITEMS,
# and in a checkpoint's state dicts every item of a batch is the same record after its name: a
# tensor, a ``torch.Size``, a fragment address, a module's ``_metadata`` entry. Once one record
# is taken, the ones after it are read name by name (its length, then the record's regular
# expression right after it) and judged together by C loops over their columns, not record by
# record in Python:
#
# - the memo indices the run writes increase from one put to the next (torch.save's are
#   consecutive) and stay below the pickle's length: each is written once, none past the end;
# - every index a record reads is below the first index it writes (it reads only what came
#   before, as ``named_record`` requires), was written, and holds no tuple where the record's
#   persistent id holds it.
#
# Then the run's writes and pushes are applied at once: what ``named_record`` applies record by
# record. A run failing any check is left untouched to ``named_record`` and the walk, so verdicts
# and messages stay the walk's; the walk of the model states runs fewer instructions
# (docs/performance.md). ``tests/checkpoint/test_torch_records.py`` compares the walk with and without.

_MIN_RUN = 4  # fewer records than this: the record-by-record lane is as quick
_SHAPE_PUT = rb"(?:%s\x85|%s{2}\x86|%s{3}\x87|\(%s*t)" % ((_INT,) * 4) + _PUT  # a shape of 1+ dimensions
_U32_FROM = struct.Struct("<I").unpack_from


class _Kind:
    """One record kind: its regular expression (what follows a name) and, for each of its groups,
    whether it is a put (with the depth the walk stores there) or a read (and must it hold no tuple)."""

    def __init__(self, record: bytes, fields: tuple, pushed: int = 1) -> None:
        self.pushed = pushed  # what a record leaves on the stack: 1, a call's result, unless told
        self.record = re.compile(record, re.DOTALL).match
        self.puts = [i for i, f in enumerate(fields) if f[0] == "put"]
        self.put_fields = itemgetter(*self.puts)
        self.depths = [f[1] for f in fields if f[0] == "put"]
        self.reads = [i for i, f in enumerate(fields) if f[0] == "read"]
        self.flat = [i for i, f in enumerate(fields) if f == ("read", True)]


_R, _Z, _P = ("read", False), ("read", True), "put"


def _tensor_kind(key: bytes, key_field: tuple) -> _Kind:
    """A state dict entry: reads fn, then storage, class, ``key``, device (the persistent id: no
    tuple), then OrderedDict."""
    return _Kind(
        _PUT + _GET + rb"\(\(" + _GET + _GET + key + _GET + _INT + b"t" + _PUT + b"Q" + _INT + _SHAPE_PUT
        + _SHAPE_PUT + rb"[\x88\x89]" + _GET + rb"\)R" + _PUT + b"t" + _PUT + b"R" + _PUT,
        ((_P, 0), _R, _Z, _Z, key_field, _Z, (_P, 1), (_P, 1), (_P, 1), _R, (_P, 1), (_P, 2), (_P, 1)),
    )  # fmt: skip


TENSOR = _tensor_kind(_GET, _Z)  # a storage named before (views of one flat buffer)
TENSOR_NEW_KEY = _tensor_kind(_NEW_KEY, (_P, 0))  # a storage of its own, named here (a put among the reads)
SHAPE = _Kind(_PUT + _GET + _SHAPE_PUT + rb"\x85" + _PUT + b"R" + _PUT, ((_P, 0), _R, (_P, 1), (_P, 2), (_P, 1)))
OBJECT = _Kind(
    _PUT + _GET + rb"\)\x81" + _PUT + b"}" + _PUT + rb"\(" + _GET + _INT + _GET + _INT + b"ub",
    ((_P, 0), _R, (_P, 1), (_P, 0), _R, _R),
)


# A module's ``_metadata`` entry: its name, then ``{"version": 1}`` (EMPTY_DICT, a key read, an
# int, SETITEM): one per module, 60k in a model of 100k tensors.
METADATA = _Kind(_PUT + b"}" + _PUT + _GET + _INT + b"s", ((_P, 0), (_P, 0), _R), pushed=0)


def _fields(kind: _Kind, data: bytes, pos: int, unnamed: bool) -> tuple[list, int]:
    """The groups of each record of ``kind`` from ``pos`` on, each after a name (BINUNICODE, its
    length, that many bytes) that starts where the one before ends, and where they end.
    ``unnamed``: the first record starts at ``pos`` (its name was read before)."""
    found: list = []
    match, u32, n = kind.record, _U32_FROM, len(data)
    if unnamed:
        if not (m := match(data, pos)):
            return found, pos
        found.append(m)
        pos = m.end()
    while pos + 5 < n and data[pos] == 0x58 and (m := match(data, pos + 5 + u32(data, pos + 1)[0])):
        found.append(m)
        pos = m.end()
    return list(map(re.Match.groups, found)), pos


def take_run(kind: _Kind, data: bytes, pos: int, n: int, memo: dict, stack: list, unnamed: bool = False) -> int:
    """At ``pos``, just after a record of ``kind`` ``named_record`` took (``unnamed``: just after a
    name, the run's first record next): the position after the run of named records of that kind
    that follows, its effect applied, if the walk would take every one of them without a doubt;
    else 0, with nothing changed."""
    rows, end = _fields(kind, data, pos, unnamed)
    count = len(rows)
    if count < _MIN_RUN:
        return 0
    column = list(zip(*rows))
    puts = list(struct.unpack(f"<{count * len(kind.puts)}I", b"".join(chain.from_iterable(map(kind.put_fields, rows)))))
    first, last = puts[0], puts[-1]
    # torch.save memoizes with consecutive indices; anything else must still only increase.
    if last >= n or (puts != list(range(first, last + 1)) and not all(map(operator.lt, puts, islice(puts, 1, None)))):
        return 0
    index_of = {token: _index(token) for token in set().union(*(column[i] for i in kind.reads))}
    writes: Iterable[tuple[int, int]] = zip(puts, chain.from_iterable(repeat(kind.depths, count)))
    written: dict = {}
    if max(index_of.values()) >= first:  # a read inside the run's own indices: record by record
        reads = [list(map(index_of.__getitem__, column[i])) for i in kind.reads]
        if not all(map(operator.lt, map(max, *reads) if len(reads) > 1 else reads[0], puts[:: len(kind.puts)])):
            return 0
        writes = written = dict(writes)
    flat = {index_of[token] for token in set().union(*(column[i] for i in kind.flat))}
    for index in set(index_of.values()):
        depth = written.get(index, memo.get(index))
        if depth is None or (depth and index in flat):
            return 0  # never written (the walk's KeyError), or a tuple in a persistent id
    memo.update(writes)
    stack.extend([0, kind.pushed] * count)  # each record's name, and what the record leaves
    if unnamed:
        del stack[-2]  # the first name is on the stack already
    return end

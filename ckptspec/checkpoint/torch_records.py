"""The fast lane of ``scan_pickle``: the three records ``torch.save`` writes by the hundred
thousand, recognised whole.

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

import re
import struct
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


def _read_plan(tokens: bytes) -> tuple:
    """(first index, a getter of the middle ones, last index, the largest index) for the memo reads
    a record's tokens make, decoded once per distinct run of tokens."""
    plan = _reads.get(tokens)
    if plan is None:
        found, i = [], 0
        while i < len(tokens):
            if tokens[i] == 0x68:
                found.append(tokens[i + 1])
                i += 2
            else:
                found.append(_U32(tokens[i + 1 : i + 5])[0])
                i += 5
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
        return 0
    name, fn, storage, cls, key, new_key, device, persid, size, stride, od_fn, od, args, result = m.groups()[:14]
    if storage is None:
        return _named_shape(m, n, memo, stack) if m.lastindex <= 17 else _named_object(m, n, memo, stack)
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
    return m.end()


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
    return m.end()

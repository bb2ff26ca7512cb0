"""Checks around the restricted unpickler: what a hostile ``data.pkl`` could do to the process.

Before unpickling, ``scan_pickle`` walks the opcodes and refuses memo indices that would make the
C unpickler allocate memory in proportion to them, and tuples nested deeper than ``MAX_NESTING``
(hashing one recurses in C and can crash the interpreter); ``torch_records`` takes the records
``torch.save`` writes by the hundred thousand whole. After it, ``check_tree`` makes sure the
result is a tree a recursive walker can handle: no cycles, at most ``MAX_NESTING`` deep, not
exponentially large through shared references. Both raise ``ValueError``; ``torchfile`` turns
that into a ``TorchFileError`` naming the file.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import torch_records
from .standins import DType, FragmentAddress, LossScalerState, StorageRef, TensorRef, ZeroStage

PASSED_EVERY = 512 * 1024  # how often walk() reports its progress, in bytes
MAX_NESTING = 100  # containers in a DeepSpeed checkpoint nest about 6 deep
_U32_AT = struct.Struct("<I").unpack_from  # a 4-byte argument, without the slice int.from_bytes needs


# Opcode argument layouts (pickletools' table, by opcode byte) and, for scan_pickle's general
# path, their effect on the stack.
_FIXED = {
    **dict.fromkeys(b"KhqCU\x80\x82\x8c\x8a", 1),
    **dict.fromkeys(b"M\x83", 2),
    **dict.fromkeys(b"Jjr\x84TBX\x8b", 4),
    **dict.fromkeys(b"G\x95\x8d\x8e\x96", 8),
}
_COUNTED = frozenset(b"CU\x8c\x8aTBX\x8b\x8d\x8e\x96")  # the argument is a byte count; the bytes follow
_LINES = {**dict.fromkeys(b"ILFSVgpP", 1), **dict.fromkeys(b"ci", 2)}
_NO_ARG = frozenset(b"(.012NRabd}elo]st)uQ\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98")
_PUSH = frozenset(b"N\x88\x89KMJGILFSVUC\x8c\x8aTBX\x8b\x8d\x8e\x96]}\x8fc\x82\x83\x84P\x97")  # push one non-tuple


def scan_pickle(data: bytes) -> None:
    """Walk the opcodes of ``data`` as the unpickler will, before it runs, and refuse what
    would harm the process: a memo index past the pickle's length (the C unpickler grows its
    memo array to twice the index: a 9-byte pickle could claim 32 GB), and tuples nested more
    than MAX_NESTING deep (hashing one, as a dict key or set element, recurses in C without a
    limit and crashes the interpreter). Tracks the tuple depth of every stack slot and memo
    entry; anything but a tuple counts 0 (other containers are unhashable or, for frozenset,
    hash without recursing), and a call's result counts 1 (see ALLOWED). Anything the
    unpickler would fail on (an unknown opcode, a cut argument, a missing MARK) fails here.
    """
    walk(data, fast=True)


def walk(data: bytes, fast: bool, passed: Callable[[int], object] | None = None) -> tuple[dict, list, list]:
    """scan_pickle's walk. ``fast``: take the records ``torch_records`` knows whole. ``passed``:
    called with a position every ``PASSED_EVERY`` bytes or so, once every opcode before it has
    passed (``prescan`` lets the unpickler that far). Returns the memo, the stack (as tuple
    depths) and the marks at STOP: tests compare them with and without the fast lane."""
    n = len(data)
    stack: list[Any] = []
    marks: list[int] = []
    pos, memo = 0, {}
    next_report = PASSED_EVERY if passed is not None else 1 << 62  # (no argument moves pos that far)
    push, pop, u32 = stack.append, stack.pop, _U32_AT
    named_record = torch_records.named_record

    def to_mark():
        if not marks:
            raise ValueError(f"no MARK before byte {pos}")
        items = stack[marks[-1] :]
        del stack[marks.pop() :]
        return items

    def tuple_of(items):
        depth = 1 + max(items, default=0)
        if depth > MAX_NESTING:
            raise ValueError(f"tuples nest deeper than {MAX_NESTING} levels at byte {pos}")
        return depth

    def put(index):
        if not 0 <= index < n:
            raise ValueError(f"memo index {index} at byte {pos} is beyond the pickle's {n} bytes")
        memo[index] = stack[-1]

    try:
        while True:
            if pos >= next_report:
                if pos > n:  # the last opcode's argument claims bytes past the end: never pass it
                    raise IndexError
                if passed is not None:  # (without it next_report is never reached)
                    passed(pos)
                next_report = pos + PASSED_EVERY
            op = data[pos]
            # The opcodes torch.save writes most, argument and stack effect in one go, most frequent
            # first (a 100k-tensor model-states pickle: 4.5M opcodes, 1.25M of them LONG_BINPUT).
            if op == 0x72:  # LONG_BINPUT (put() inlined: this is a quarter of all opcodes)
                index = u32(data, pos + 1)[0]
                if index >= n:
                    put(index)
                memo[index] = stack[-1]
                pos += 5
            elif op == 0x68:  # BINGET
                push(memo[data[pos + 1]])
                pos += 2
            elif op == 0x4B:  # BININT1
                push(0)
                pos += 2
            elif op == 0x85:  # TUPLE1
                stack[-1] = tuple_of((stack[-1],)) if stack[-1] else 1  # as tuple_of((0,))
                pos += 1
            elif op == 0x52:  # REDUCE
                pop()
                stack[-1] = 1
                pos += 1
            elif op == 0x58:  # BINUNICODE
                pos += 5 + u32(data, pos + 1)[0]
                push(0)
                if fast:  # a name: a state dict entry or a named shape may follow (torch_records)
                    pos = named_record(data, pos, n, memo, stack) or pos
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif op == 0x74:  # TUPLE
                push(tuple_of(to_mark()))
                pos += 1
            elif op == 0x4A:  # BININT
                push(0)
                pos += 5
            elif op == 0x6A:  # LONG_BINGET
                push(memo[u32(data, pos + 1)[0]])
                pos += 5
            elif op == 0x29:  # EMPTY_TUPLE
                push(1)
                pos += 1
            elif op == 0x51:  # BINPERSID
                stack[-1] = 0
                pos += 1
            elif op == 0x89 or op == 0x88 or op == 0x4E:  # NEWFALSE, NEWTRUE, NONE
                push(0)
                pos += 1
            elif op == 0x7D:  # EMPTY_DICT
                push(0)
                pos += 1
            elif op == 0x73:  # SETITEM
                pop()
                pop()
                pos += 1
            elif op == 0x86:  # TUPLE2
                b = pop()
                a = stack[-1]
                if a or b:
                    stack[-1] = tuple_of((a, b))
                else:
                    stack[-1] = 1
                pos += 1
            elif op == 0x71:  # BINPUT
                put(data[pos + 1])
                pos += 2
            elif op == 0x4D:  # BININT2
                push(0)
                pos += 3
            elif op == 0x2E:  # STOP
                return memo, stack, marks
            else:
                pos = _scan_rare(op, data, pos, stack, marks, memo, to_mark, tuple_of, put)
    except (IndexError, struct.error):
        raise ValueError("pickle data was truncated, or an opcode finds too few values on the stack") from None
    except KeyError as e:
        raise ValueError(f"memo value not found at index {e}") from None


def _scan_rare(op, data, pos, stack, marks, memo, to_mark, tuple_of, put):
    """scan_pickle for every other opcode: returns the position of the next one."""
    start = pos
    pos += 1
    width = _FIXED.get(op)
    if width is not None:
        if pos + width > len(data):
            raise IndexError
        arg = int.from_bytes(data[pos : pos + width], "little")
        pos += width + (arg if op in _COUNTED else 0)
    elif op in _LINES:
        line_start = pos
        for _ in range(_LINES[op]):
            end = data.find(b"\n", pos)
            if end < 0:
                raise IndexError
            pos = end + 1
        if op == 0x70:  # PUT
            put(int(data[line_start:pos]))
            return pos
        if op == 0x67:  # GET
            stack.append(memo[int(data[line_start:pos])])
            return pos
    elif op not in _NO_ARG:
        raise ValueError(f"unknown opcode {op:#04x} at byte {start}")
    if op in _PUSH:
        stack.append(0)
    elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
        stack.append(memo[arg])
    elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
        put(arg)
    elif op == 0x94:  # MEMOIZE: the next free index, like the unpickler's
        memo[len(memo)] = stack[-1]
    elif op == 0x87:  # TUPLE3
        items = stack[-3:]
        if len(items) < 3:
            raise IndexError
        del stack[-3:]
        stack.append(tuple_of(items))
    elif op in b"ld\x91":  # LIST, DICT, FROZENSET: the items since MARK become one value
        to_mark()
        stack.append(0)
    elif op in b"io":  # INST, OBJ: a call on the items since MARK
        to_mark()
        stack.append(1)
    elif op in b"eu\x901":  # APPENDS, SETITEMS, ADDITEMS, POP_MARK
        to_mark()
    elif op == 0x30:  # POP: an item, or the MARK on top
        if marks and marks[-1] == len(stack):
            marks.pop()
        else:
            stack.pop()
    elif op == 0x32:  # DUP
        stack.append(stack[-1])
    elif op in b"ab":  # APPEND, BUILD
        stack.pop()
    elif op == 0x73:  # SETITEM
        stack.pop(), stack.pop()
    elif op in b"\x81\x93":  # NEWOBJ, STACK_GLOBAL: two values -> one
        stack.pop()
        stack[-1] = 1
    elif op == 0x92:  # NEWOBJ_EX
        stack.pop(), stack.pop()
        stack[-1] = 1
    elif op == 0x98:  # READONLY_BUFFER
        stack[-1]
    # Everything else (PROTO, FRAME, and the opcodes scan_pickle handles itself) only has its argument.
    return pos


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, StorageRef, ZeroStage, DType, FragmentAddress})
_FLAT_KINDS = _LEAVES | {TensorRef, tuple, dict}
_ATTRS = operator.attrgetter("attrs")


def _children(obj):
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        extra = getattr(obj, "__dict__", None)  # an OrderedDict's attributes (BUILD)
        return (*obj.keys(), *obj.values(), *([extra] if extra else []))
    if isinstance(obj, TensorRef):
        return (obj.attrs,) if obj.attrs else None
    if isinstance(obj, LossScalerState):
        return (obj.state,)
    return None


def _of_type(parts, kinds, kind) -> list:
    """The parts of ``parts`` holding ``kind``, each narrowed to the items of exactly that type by
    C loops (``kinds``: the types each part holds). A part of that type alone is taken as it is:
    copying a million references touches a million objects."""
    found = []
    for part, held in zip(parts, kinds):
        if held == {kind}:
            found.append(part)
        elif kind in held:
            found.append(list(itertools.compress(part, map(operator.is_, map(type, part), itertools.repeat(kind)))))
    return found


def _flat(container, attributes_apart: bool = False) -> tuple[int, int] | None:
    """(nodes, height) of a list, or a dict without attributes, whose items are all leaves (tensors
    without attributes included), tuples of leaves or dicts of leaves: what check_tree's walk of it
    would count. None for any other container, which check_tree walks item by item. A state dict's
    shapes, a module's ``_metadata`` (a dict of leaves per submodule): counted in C.
    ``attributes_apart``: count a dict's keys and values even if it has attributes (a module's state
    dict, given ``_metadata`` by BUILD), leaving those to the caller."""
    parts: tuple[Any, ...]
    if type(container) is list:
        parts = (container,)
    elif not attributes_apart and getattr(container, "__dict__", None):  # an OrderedDict given attributes by BUILD
        return None
    else:
        parts = (container.keys(), container.values())
    held = [set(map(type, part)) for part in parts]
    kinds = set().union(*held)
    if not kinds <= _FLAT_KINDS:
        return None
    nodes, height = 1 + sum(map(len, parts)), 1
    chain = itertools.chain.from_iterable
    if TensorRef in kinds and any(map(_ATTRS, chain(_of_type(parts, held, TensorRef)))):
        return None
    if tuple in kinds:
        shapes = _of_type(parts, held, tuple)
        if not _LEAVES.issuperset(map(type, chain(chain(shapes)))):
            return None
        nodes, height = nodes + sum(map(len, chain(shapes))), 2
    if dict in kinds:
        inner = list(chain(_of_type(parts, held, dict)))
        keys = itertools.chain.from_iterable(map(dict.keys, inner))
        values = itertools.chain.from_iterable(map(dict.values, inner))
        if not (_LEAVES.issuperset(map(type, keys)) and _LEAVES.issuperset(map(type, values))):
            return None
        nodes, height = nodes + 2 * sum(map(len, inner)), 2
    return nodes, height


def _frame(obj, depth: int, max_nodes: int) -> list | None:
    """check_tree's frame for ``obj`` at ``depth`` (object, its children, nodes so far, tallest
    child), or None for a leaf. A dict given attributes (a module's state dict and its
    ``_metadata``): its keys and values counted in C when they are flat and pass on their own, so
    the frame walks only the attributes; else the walk meets any refusal where it would."""
    if (type(obj) is dict or type(obj) is OrderedDict) and getattr(obj, "__dict__", None):
        items = _flat(obj, attributes_apart=True)
        if items is not None and items[0] <= max_nodes and depth + items[1] <= MAX_NESTING:
            return [obj, iter((obj.__dict__,)), items[0], items[1] - 1]
    kids = _children(obj)
    return None if kids is None else [obj, iter(kids), 1, 0]


def check_tree(root, max_nodes: int) -> None:
    """The unpickled object must be a tree as a recursive walker sees it: no cycles, at most
    MAX_NESTING deep, at most ``max_nodes`` nodes when a shared object counts once per place
    it appears (the memo can share one list at every level: 2**64 paths from 700 bytes).
    Iterative, and each shared object is measured once."""
    done: dict[int, tuple[int, int]] = {}  # id -> (nodes, height) of a finished container
    root_frame = _frame(root, 0, max_nodes)
    if root_frame is None:
        return
    path = {id(root)}
    stack = [root_frame]  # object, its children, nodes so far, tallest child
    leaves = _LEAVES
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            kind = type(child)
            if kind in leaves or (kind is TensorRef and not child.attrs):
                frame[2] += 1
                continue
            if kind is tuple and leaves.issuperset(map(type, child)):
                # A tuple of leaves (a shape, a stride): what its own frame would count, without one.
                if len(stack) >= MAX_NESTING:
                    raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
                frame[2] += 1 + len(child)
                frame[3] = max(frame[3], 1)
                continue
            known = done.get(id(child))
            if known is None and (kind is dict or kind is OrderedDict or kind is list):
                known = _flat(child)  # a state dict, a list of shapes: counted in C, no frame of its own
                if known is not None:  # what finishing its frame would check, in that order
                    if len(stack) + known[1] > MAX_NESTING:
                        raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
                    if known[0] > max_nodes:
                        raise ValueError(f"data.pkl's objects, counted once per place they appear, exceed {max_nodes}")
                    done[id(child)] = known
            if known is not None:
                if len(stack) + known[1] > MAX_NESTING:
                    raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
                frame[2] += known[0]
                frame[3] = max(frame[3], known[1])
                continue
            child_frame = _frame(child, len(stack), max_nodes)
            if child_frame is None:
                frame[2] += 1
                continue
            if id(child) in path:
                raise ValueError("data.pkl holds a reference cycle")
            if len(stack) >= MAX_NESTING:
                raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
            path.add(id(child))
            stack.append(child_frame)
            break
        else:
            stack.pop()
            obj, nodes, height = frame[0], frame[2], frame[3] + 1
            if nodes > max_nodes:
                raise ValueError(f"data.pkl's objects, counted once per place they appear, exceed {max_nodes}")
            done[id(obj)] = (nodes, height)
            path.discard(id(obj))
            if stack:
                stack[-1][2] += nodes
                stack[-1][3] = max(stack[-1][3], height)

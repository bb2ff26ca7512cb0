"""CK235 in one data-parallel domain: the module's weights are its fp32 masters cast to the run's dtype.

DeepSpeed's ZeRO-1/2 step copies each rank's fp32 master partition into the flat low-precision group the
module's parameters are views of (``bit16_partitions[r].data.copy_(fp32_partition)``: torch's cast, to
nearest, ties to even, in bf16 and fp16 alike; fp32 copies the bits), so at a save the model states'
``module`` holds every master rounded to the run's dtype, element for element. A model-states file of
another run (another seed, data or dtype) keeps every name, shape and flat offset the other checks compare;
its values cannot be this run's masters. ZeRO-3 saves empty placeholders in the module (the partitions are
in the optimizer files only): nothing to compare but their dtype.

The run's dtype is read from the optimizer files' own ``ds_config`` (the files of the masters), not from
the model states under test. Cheap: the first few elements of at most ``PIECES`` parameter pieces per group
and rank, spread over the group (two small reads each, no tensor decoded).
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_right
from collections.abc import Callable, Iterator

from ....checkpoint.torchfile import TensorRef, tensor_byte_range
from ....errors import CkptspecError
from ....findings import Finding, RuleSet, finding, json_path
from ....location import open_binary
from ...layout.state_fields import dtype_of_config
from .context import Check, Context, File

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register

SAMPLE = 4  # elements compared per piece: a copy of another run differs in (almost) every element
PIECES = 64  # pieces compared per group and rank, spread over the group (all of them in a small model)


def bf16_bits(fp32: bytes) -> bytes:
    """fp32 little-endian words rounded to bfloat16 as torch rounds (to nearest, ties to even)."""
    out = []
    for (word,) in struct.iter_unpack("<I", fp32):
        if (word & 0x7F800000) == 0x7F800000 and word & 0x7FFFFF:  # NaN: quieted, sign kept
            out.append((word >> 16) | 0x40)
        else:
            out.append((word + 0x7FFF + ((word >> 16) & 1)) >> 16)
    return struct.pack(f"<{len(out)}H", *out)


def fp16_bits(fp32: bytes) -> bytes:
    """fp32 little-endian words rounded to float16 as torch rounds (to nearest, ties to even)."""
    out = []
    for (value,) in struct.iter_unpack("<f", fp32):
        try:
            out.append(struct.pack("<e", value))
        except OverflowError:  # past float16's range: infinity, as torch gives
            out.append(struct.pack("<e", math.copysign(math.inf, value)))
    return b"".join(out)


ROUND: dict[str, Callable[[bytes], bytes]] = {"float32": lambda b: b, "bfloat16": bf16_bits, "float16": fp16_bits}


def run_dtype(optimizer_states: list, default: str) -> str:
    """The run's dtype as the files of its masters record it (their ``ds_config``), else ``default``."""
    for state in optimizer_states:
        config = state.get("ds_config") if isinstance(state, dict) else None
        if isinstance(config, dict):
            return dtype_of_config(config)
    return default


def _read(fh, offset: int, size: int) -> bytes:
    fh.seek(offset)
    return fh.read(size)


def _pieces(grp, rank: int, module: dict, dtype: str, offsets: list[int] | None) -> Iterator[tuple]:
    """(param, its module tensor, start in the rank's partition, elements of the param left there): the
    start of each of the rank's pieces in a group of at most ``PIECES`` parameters, else ``PIECES`` points
    spread over its partition, each found by bisection in ``offsets`` (no loop over 100k parameters)."""
    lo, numel = rank * grp.partition_numel, grp.partition_numel
    if offsets is None:
        found = [(p, max(p.offset, lo)) for p in grp.params if p.offset < lo + numel and lo < p.offset + p.numel]
    else:
        points = sorted({lo + k * numel // PIECES for k in range(PIECES)})
        found = [(grp.params[j], at) for at in points if (j := bisect_right(offsets, at) - 1) >= 0]
    for p, at in found:
        if not p.offset <= at < p.offset + p.numel:
            continue  # padding
        ref = module.get(p.name)
        if isinstance(ref, TensorRef) and ref.dtype == dtype and ref.is_contiguous():
            yield p, ref, at - lo, min(p.offset + p.numel, lo + numel) - at


@check("CK235")
def module_weights_are_masters(ctx: Context) -> Iterator[Finding]:
    layout = ctx.layout
    optim = [f for f in ctx.readable("optimizer_states") if isinstance(f.state, dict)]
    dtype = run_dtype([f.state for f in optim], layout.model_dtype)
    for f, module in ctx.modules():
        yield from _other_dtype(ctx, f, module, dtype)
    if layout.zero_stage not in (1, 2) or layout.master_dtype != "float32" or dtype not in ROUND:
        return
    masters = {(loc.group, f.rank): (f, loc) for f in optim if f.rank is not None for loc in f.entry.partitions or ()}
    for f, module in ctx.modules():
        yield from _values(ctx, f, module, dtype, masters)


def _other_dtype(ctx: Context, f: File, module: dict, dtype: str) -> Iterator[Finding]:
    """Every trainable parameter's saved copy is in the run's dtype (ZeRO-3's empty placeholders too)."""
    for grp in ctx.manifest.groups:
        for p in grp.params:
            ref = module.get(p.name)
            if isinstance(ref, TensorRef) and ref.dtype != dtype:
                yield finding(
                    "CK235",
                    ctx.name_path(p.name),
                    f"{p.name} is saved as {ref.dtype} in the module; the run's dtype is {dtype} (the config its "
                    "optimizer files record): a model-states file of another run",
                    "restore the files of one save",
                    file=f.name,
                    rank=f.rank,
                )
                return  # one per file: the whole file is of another run


def _values(ctx: Context, f: File, module: dict, dtype: str, masters: dict) -> Iterator[Finding]:
    """The sampled pieces of every flat group, per rank: the bytes the module holds against the master's."""
    if f.loaded is None or f.path is None:
        return
    members = f.loaded.members or {}
    wrong: dict[int, tuple[str, int, File]] = {}  # rank -> first (param, element) found wrong, its file
    compared: set[int] = set()
    try:
        wfh = open_binary(f.path)
    except OSError:
        return
    handles: dict[str, object] = {}
    try:
        for g, grp in enumerate(ctx.manifest.groups):
            if grp.partitioning != "flat":
                continue
            offsets = [p.offset for p in grp.params] if len(grp.params) > PIECES else None
            for rank in range(grp.partition_count):
                if (g, rank) not in masters or rank in wrong:
                    continue
                of, loc = masters[(g, rank)]
                if loc.dtype != "float32":
                    continue
                for p, ref, start, count in _pieces(grp, rank, module, dtype, offsets):
                    n = min(SAMPLE, count, loc.numel - start)
                    if n <= 0:
                        continue
                    first = rank * grp.partition_numel + start - p.offset  # element of the parameter
                    try:
                        base, _ = tensor_byte_range(ref, members)
                        if of.name not in handles:
                            handles[of.name] = open_binary(of.path)
                        master = _read(handles[of.name], loc.data_offset + (loc.element_offset + start) * 4, n * 4)
                        saved = _read(wfh, base + first * ref.storage.itemsize, n * ref.storage.itemsize)
                    except (CkptspecError, OSError, ValueError):
                        continue  # unreadable or damaged files are the other checks' findings
                    if len(master) != n * 4:
                        continue
                    compared.add(rank)
                    if saved != ROUND[dtype](master):
                        wrong[rank] = (f"{p.name} (elements {first}..{first + n - 1})", g, of)
                        break
    finally:
        wfh.close()
        for fh in handles.values():
            fh.close()  # type: ignore[attr-defined]
    if not wrong:
        return
    hint = "a file of another run, seed, dtype or save: restore the files of one save, each under its own name"
    if len(wrong) * 2 > len(compared):  # most ranks' masters disagree with the module: it is the odd file
        rank = min(wrong)
        what, g, of = wrong[rank]
        others = (
            f" (nor are the masters of {len(wrong) - 1} more of the {len(compared)} ranks)" if len(wrong) > 1 else ""
        )
        yield finding(
            "CK235",
            json_path("groups", g),
            f"{what} saved in {f.name} is not its fp32 master in {of.name} rounded to {dtype}{others}",
            hint,
            file=f.name,
            rank=f.rank,
        )
        return
    for rank in sorted(wrong):  # the module agrees with most ranks' masters: these optimizer files are the odd ones
        what, g, of = wrong[rank]
        yield finding(
            "CK235",
            json_path("groups", g),
            f"{what} saved in {f.name} is not its fp32 master in {of.name} rounded to {dtype}; "
            f"those of {len(compared) - len(wrong)} of the {len(compared)} ranks are",
            hint,
            file=of.name,
            rank=of.rank,
        )

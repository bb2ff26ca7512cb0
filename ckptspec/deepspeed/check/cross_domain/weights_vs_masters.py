"""CK235: the saved weights of every tensor/pipeline coordinate are its optimizer files' masters.

DeepSpeed's ZeRO-1/2 step (and BF16_Optimizer's) copies each rank's fp32 master partition into the
low-precision parameters it then gathers, so at a save the weights a rank wrote (AutoTP: the
``module`` of its model states; a pipeline: its stage's layer files) are its masters rounded to the
model dtype, element for element. Two files of different tensor ranks, stages or layers can have
the same names, shapes and sizes (every other check passes when AutoTP's ranks swap their optimizer
files, or a pipeline's two Blocks swap layer files); their values cannot agree with the other
coordinate's masters. Cheap: the first few elements of each piece of each parameter, two ``pread``
each, no tensor decoded (bfloat16 rounding done on the bits). Stage 3 (no weights in the files) and
ZeRO-1/2 fp16 (loss-scaled copies) are not compared; located stage-0 and MoE masters are, in fp16 too.

The same holds where the index locates the masters apart from the weights (ZeRO stage 0's
``FP16_Optimizer`` and ``FP16_UnfusedOptimizer``, which copy every master into its weight after each
step, in bf16 or fp16; MoE): there it is also the evidence that the producer named the masters right.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

from ....checkpoint.torchfile import TensorRef, tensor_byte_range
from ....errors import CkptspecError
from ....findings import Finding, finding, json_path
from ....format.index_models import MasterLocator
from ....format.partition import param_pieces
from ....format.paths import join_inside
from ....location import read_range
from .context import IndexContext, check

SAMPLE = 4  # elements compared per piece: a swapped file differs in (almost) every element


def _bf16_bits(fp32: bytes) -> bytes:
    """fp32 little-endian words rounded to bfloat16 as torch rounds (to nearest, ties to even)."""
    out = []
    for (word,) in struct.iter_unpack("<I", fp32):
        if (word & 0x7F800000) == 0x7F800000 and word & 0x7FFFFF:  # NaN: quieted, sign kept
            out.append((word >> 16) | 0x40)
        else:
            out.append((word + 0x7FFF + ((word >> 16) & 1)) >> 16)
    return struct.pack(f"<{len(out)}H", *out)


def _weights(ctx: IndexContext, i: int) -> dict[str, tuple[str, TensorRef]]:
    """Local name -> (file, tensor) of domain ``i``'s saved weights: its module, or its layer files."""
    domain = ctx.index.domains[i]
    out: dict[str, tuple[str, TensorRef]] = {}
    for f in domain.manifest.files:
        path = join_inside(ctx.tag_dir, f.path)
        if f.role == "model_states" and path is not None and path.is_file():
            loaded = ctx.states.load(path)
            module = loaded.state.get("module") if loaded.error is None and isinstance(loaded.state, dict) else None
            for name, ref in (module or {}).items():
                out[name] = (f.path, ref)
            break
    for param in ctx.index.parameters:
        for s in param.shards:
            if s.domain != domain.id or not s.layer_file:
                continue
            path = join_inside(ctx.tag_dir, s.layer_file)
            loaded = ctx.states.load(path) if path is not None and path.is_file() else None
            if loaded is not None and loaded.error is None and isinstance(loaded.state, dict):
                if s.layer_key in loaded.state:
                    out[s.local_name] = (s.layer_file, loaded.state[s.layer_key])
    return out


@check("CK235")
def weights_are_masters(ctx: IndexContext) -> Iterator[Finding]:
    for i, domain in enumerate(ctx.index.domains):
        layout = domain.manifest.layout
        if (
            layout.zero_stage == 3
            or layout.master_dtype != "float32"
            or layout.model_dtype not in ("float32", "bfloat16")
        ):
            continue
        weights = _weights(ctx, i)
        partitions = {
            (loc.group, loc.rank): (f.path, loc)
            for f in domain.manifest.files
            if f.role == "optimizer_states"
            for loc in f.partitions
        }
        reported: set[tuple[str, str]] = set()
        for group in domain.manifest.groups:
            if group.partitioning != "flat":
                continue
            for param in group.params:
                held = weights.get(param.name)
                if held is None or not isinstance(held[1], TensorRef) or held[1].dtype != layout.model_dtype:
                    continue
                wfile, ref = held
                for rank, start, count in param_pieces(
                    "flat", group.partition_count, group.partition_numel, param.offset, param.numel, param.padding
                ):
                    if (group.optimizer_group, rank) not in partitions:
                        continue
                    ofile, loc = partitions[(group.optimizer_group, rank)]
                    if (wfile, ofile) in reported or loc.dtype != "float32" or start >= loc.numel:
                        continue
                    n = min(SAMPLE, count, loc.numel - start)
                    first = rank * group.partition_numel + start - param.offset  # element of the parameter
                    try:
                        base, _ = tensor_byte_range(ref, ctx.states.members(ctx.tag_dir / wfile))
                        master = read_range(
                            ctx.tag_dir / ofile, loc.data_offset + (loc.element_offset + start) * 4, n * 4
                        )
                        saved = read_range(
                            ctx.tag_dir / wfile, base + first * ref.storage.itemsize, n * ref.storage.itemsize
                        )
                    except (CkptspecError, OSError, ValueError):
                        continue  # unreadable or damaged files are the other checks' findings
                    want = master if layout.model_dtype == "float32" else _bf16_bits(master)
                    if len(master) == n * 4 and saved != want:
                        reported.add((wfile, ofile))
                        odd = wfile if wfile != _model_file(domain) else ofile
                        yield finding(
                            "CK235",
                            json_path("domains", i),
                            f"{param.name} (elements {first}..{first + n - 1}) saved in {wfile} is not its fp32 "
                            f"master in {ofile} rounded to {layout.model_dtype}",
                            "a file of another tensor rank, stage or layer (swapped files?): restore the files of "
                            "one save, each under its own name",
                            file=odd,
                            rank=rank if odd == ofile else None,  # a layer file has no data-parallel rank
                        )


@check("CK235")
def layer_weights_are_masters(ctx: IndexContext) -> Iterator[Finding]:
    """The same for a domain whose index locates its masters (a stage-0 pipeline's ``BF16_Optimizer``):
    each layer file's weights against the first elements of each piece of their masters."""
    for i, domain in enumerate(ctx.index.domains):
        layout = domain.manifest.layout
        if domain.masters is None or layout.model_dtype not in ("float32", "bfloat16"):
            continue
        # The layer files' weights only: a stage-0 module's are compared by no check yet.
        weights = {n: held for n, held in _weights(ctx, i).items() if held[0] != _model_file(domain)}
        reported: set[str] = set()
        done: dict[str, int] = {}  # parameter -> its elements located so far (its pieces are in order)
        for loc in domain.masters.tensors:
            first = done.get(loc.param, 0)
            done[loc.param] = first + loc.numel
            held = weights.get(loc.param)
            if held is None or held[0] in reported or loc.dtype != "float32" or not loc.numel:
                continue
            wfile, ref = held
            if not isinstance(ref, TensorRef) or ref.dtype != layout.model_dtype or first >= ref.numel:
                continue
            n = min(SAMPLE, loc.numel, ref.numel - first)
            try:
                base, _ = tensor_byte_range(ref, ctx.states.members(ctx.tag_dir / wfile))
                master = read_range(ctx.tag_dir / loc.file, loc.data_offset + loc.element_offset * 4, n * 4)
                saved = read_range(ctx.tag_dir / wfile, base + first * ref.storage.itemsize, n * ref.storage.itemsize)
            except (CkptspecError, OSError, ValueError):
                continue  # unreadable or damaged files are the other checks' findings
            want = master if layout.model_dtype == "float32" else _bf16_bits(master)
            if len(master) == n * 4 and saved != want:
                reported.add(wfile)
                yield finding(
                    "CK235",
                    json_path("domains", i),
                    f"{loc.param} (elements {first}..{first + n - 1}) saved in {wfile} is not its fp32 master in "
                    f"{loc.file} rounded to {layout.model_dtype}",
                    "a layer file of another layer or save (swapped files?): restore the files of one save, each "
                    "under its own name",
                    file=wfile,
                )


def _model_file(domain) -> str | None:
    return next((f.path for f in domain.manifest.files if f.role == "model_states"), None)


def _fp16_bits(fp32: bytes) -> bytes:
    """fp32 little-endian words rounded to float16 as torch rounds (to nearest, ties to even)."""
    out = []
    for (value,) in struct.iter_unpack("<f", fp32):
        try:
            out.append(struct.pack("<e", value))
        except OverflowError:  # past float16's range: infinity, as torch gives
            out.append(struct.pack("<e", math.copysign(math.inf, value)))
    return b"".join(out)


_ROUND = {"float32": lambda b: b, "bfloat16": _bf16_bits, "float16": _fp16_bits}


def _saved_weights(ctx: IndexContext, i: int) -> dict[str, tuple[str, TensorRef]]:
    """Whole-model name -> (file, tensor) of the weights saved beside domain ``i``'s located masters:
    its module and the MoE expert files (whose keys are the experts' whole-model names)."""
    out = dict(_weights(ctx, i))
    for ef in ctx.index.expert_files or []:
        path = join_inside(ctx.tag_dir, ef.path)
        loaded = ctx.states.load(path) if path is not None and path.is_file() else None
        if loaded is not None and loaded.error is None and isinstance(loaded.state, dict):
            out.update({name: (ef.path, loaded.state[key]) for key, name in ef.tensors.items() if key in loaded.state})
    return out


@check("CK235")
def located_masters_are_weights(ctx: IndexContext) -> Iterator[Finding]:
    """Masters the index locates apart from the weights (ZeRO stage 0 with FP16_Optimizer or
    FP16_UnfusedOptimizer, MoE): each one's first elements, rounded to its saved weight's dtype, are
    that weight's. Stage 0 records no parameter names beside its masters: the producer names them by
    the module's order, and this is the evidence."""
    for i, domain in enumerate(ctx.index.domains):
        if domain.masters is None or domain.masters.stored_in not in ("model_states", "optimizer_states"):
            continue
        # A pipeline's layer files are compared with their masters by layer_weights_are_masters, which
        # names the layer file (comparing them here too reported each swap twice, the second blaming the masters).
        layer_files = {lf.path for lf in ctx.index.layer_files}
        weights = {n: held for n, held in _saved_weights(ctx, i).items() if held[0] not in layer_files}
        first = {}
        for loc in domain.masters.tensors:
            first.setdefault(loc.param, loc)  # a master's first piece starts at its element 0
        wrong: dict[tuple[str, str], list[tuple[str, int, MasterLocator, str]]] = {}
        for name, loc in first.items():
            held = weights.get(name)
            if held is None or not isinstance(held[1], TensorRef) or loc.dtype != "float32":
                continue
            wfile, ref = held
            n = min(SAMPLE, loc.numel, ref.numel)
            if ref.dtype not in _ROUND or not n or not ref.is_contiguous():
                continue
            try:
                base, _ = tensor_byte_range(ref, ctx.states.members(ctx.tag_dir / wfile))
                master = read_range(ctx.tag_dir / loc.file, loc.data_offset + loc.element_offset * 4, n * 4)
                saved = read_range(ctx.tag_dir / wfile, base, n * ref.storage.itemsize)
            except (CkptspecError, OSError, ValueError):
                continue  # unreadable or damaged files are the other checks' findings
            if len(master) == n * 4 and saved != _ROUND[ref.dtype](master):
                wrong.setdefault((wfile, loc.file), []).append((name, n, loc, ref.dtype))
        for (wfile, mfile), found in wrong.items():  # one finding per pair of files, naming the first
            name, n, loc, dtype = found[0]
            others = f" (and {len(found) - 1} more of its {len(first)} masters)" if len(found) > 1 else ""
            yield finding(
                "CK235",
                json_path("domains", i, "masters"),
                f"{name} (elements 0..{n - 1}) saved in {wfile} is not its fp32 master in {mfile} "
                f"({'/'.join(map(str, loc.key))}) rounded to {dtype}{others}",
                "a file of another save, or masters in another order than the module's parameters (stage 0 "
                "records no names beside them): restore the files of one save, or save through "
                "ckptspec.deepspeed.save_checkpoint, which names them from the live engine",
                file=mfile,
                rank=domain.file_ranks.get(mfile),
            )

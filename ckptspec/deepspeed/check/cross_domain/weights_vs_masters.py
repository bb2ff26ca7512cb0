"""CK235 across domains: the weights saved apart from a domain's module are its masters cast to the run's dtype.

A domain's ``module`` is compared with its optimizer files' masters by the domain's own check
(``check/domain/weights.py``, which says why the copies must agree). What only the index knows is compared
here: a pipeline stage's layer files (their weights against the stage's ZeRO-1/2 optimizer files, or a
stage-0 pipeline's ``BF16_Optimizer`` masters the index locates), and the weights beside masters the index
locates apart from them (ZeRO stage 0's ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer``, which copy every
master into its weight after each step; MoE's module and expert files): there it is also the evidence that
the producer named the masters right. Two layer files of the same kind (two ``Block``s) have the same names,
shapes and sizes; a layer or expert file of another run, seed or dtype keeps them too; their values cannot
be this stage's masters rounded to the run's dtype, and a copy in another dtype than the run's is refused as
such. Cheap: the first few elements of each piece of each parameter, two ``pread`` each, no tensor decoded.
"""

from __future__ import annotations

from collections.abc import Iterator

from ....checkpoint.torchfile import TensorRef, tensor_byte_range
from ....errors import CkptspecError
from ....findings import Finding, finding, json_path
from ....format.index_models import MasterLocator
from ....format.partition import param_pieces
from ....format.paths import join_inside
from ....location import read_range
from ..domain.weights import ROUND, run_dtype
from .context import IndexContext, check

SAMPLE = 4  # elements compared per piece: a swapped file differs in (almost) every element


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
            layer = ctx.states.load(path) if path is not None and path.is_file() else None
            if layer is not None and layer.error is None and isinstance(layer.state, dict):
                if s.layer_key in layer.state:
                    out[s.local_name] = (s.layer_file, layer.state[s.layer_key])
    return out


def _run_dtype(ctx: IndexContext, i: int) -> str:
    """Domain ``i``'s dtype as its optimizer files' ``ds_config`` records it (else its layout's)."""
    domain = ctx.index.domains[i]
    states = []
    for f in domain.manifest.files:
        path = join_inside(ctx.tag_dir, f.path)
        if f.role == "optimizer_states" and path is not None and path.is_file():
            loaded = ctx.states.load(path)
            states.append(loaded.state if loaded.error is None else None)
    return run_dtype(states, domain.manifest.layout.model_dtype)


def _layer_weights(ctx: IndexContext, i: int, dtype: str) -> tuple[dict[str, tuple[str, TensorRef]], list[Finding]]:
    """Domain ``i``'s weights in layer files (its module's are the domain check's), and a finding for each
    layer file holding a weight in another dtype than the run's (a layer file of another run)."""
    domain = ctx.index.domains[i]
    weights = {n: held for n, held in _weights(ctx, i).items() if held[0] != _model_file(domain)}
    found: dict[str, Finding] = {}
    for name, (wfile, ref) in weights.items():
        if isinstance(ref, TensorRef) and ref.dtype != dtype and wfile not in found:
            found[wfile] = finding(
                "CK235",
                json_path("domains", i),
                f"{name} is saved as {ref.dtype} in {wfile}; the run's dtype is {dtype} (the config its optimizer "
                "files record): a layer file of another run",
                "restore the files of one save, each under its own name",
                file=wfile,
            )
    return weights, list(found.values())


@check("CK235")
def weights_are_masters(ctx: IndexContext) -> Iterator[Finding]:
    """A ZeRO-1/2 pipeline stage's layer files against its optimizer files' masters."""
    for i, domain in enumerate(ctx.index.domains):
        layout = domain.manifest.layout
        if layout.zero_stage == 3 or layout.master_dtype != "float32" or domain.masters is not None:
            continue
        dtype = _run_dtype(ctx, i)
        weights, other_dtype = _layer_weights(ctx, i, dtype)
        yield from other_dtype
        if dtype not in ROUND:
            continue
        partitions = {
            (loc.group, loc.rank): (f.path, loc)
            for f in domain.manifest.files
            if f.role == "optimizer_states"
            for loc in f.partitions
        }
        reported: set[str] = {f.file for f in other_dtype if f.file}
        for group in domain.manifest.groups:
            if group.partitioning != "flat":
                continue
            for param in group.params:
                held = weights.get(param.name)
                if held is None or not isinstance(held[1], TensorRef) or held[1].dtype != dtype:
                    continue
                wfile, ref = held
                for rank, start, count in param_pieces(
                    "flat", group.partition_count, group.partition_numel, param.offset, param.numel, param.padding
                ):
                    if (group.optimizer_group, rank) not in partitions:
                        continue
                    ofile, loc = partitions[(group.optimizer_group, rank)]
                    if wfile in reported or loc.dtype != "float32" or start >= loc.numel:
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
                    if len(master) == n * 4 and saved != ROUND[dtype](master):
                        reported.add(wfile)
                        yield finding(
                            "CK235",
                            json_path("domains", i),
                            f"{param.name} (elements {first}..{first + n - 1}) saved in {wfile} is not its fp32 "
                            f"master in {ofile} rounded to {dtype}",
                            "a layer file of another layer, run or save (swapped files?): restore the files of "
                            "one save, each under its own name",
                            file=wfile,  # a layer file has no data-parallel rank
                        )


@check("CK235")
def layer_weights_are_masters(ctx: IndexContext) -> Iterator[Finding]:
    """The same for a domain whose index locates its masters (a stage-0 pipeline's ``BF16_Optimizer``):
    each layer file's weights against the first elements of each piece of their masters."""
    for i, domain in enumerate(ctx.index.domains):
        if domain.masters is None:
            continue
        # The layer files' weights only: a module's are located_masters_are_weights'.
        dtype = _run_dtype(ctx, i)
        weights, other_dtype = _layer_weights(ctx, i, dtype)
        yield from other_dtype
        if dtype not in ROUND:
            continue
        reported: set[str] = {f.file for f in other_dtype if f.file}
        done: dict[str, int] = {}  # parameter -> its elements located so far (its pieces are in order)
        for loc in domain.masters.tensors:
            first = done.get(loc.param, 0)
            done[loc.param] = first + loc.numel
            held = weights.get(loc.param)
            if held is None or held[0] in reported or loc.dtype != "float32" or not loc.numel:
                continue
            wfile, ref = held
            if not isinstance(ref, TensorRef) or ref.dtype != dtype or first >= ref.numel:
                continue
            n = min(SAMPLE, loc.numel, ref.numel - first)
            try:
                base, _ = tensor_byte_range(ref, ctx.states.members(ctx.tag_dir / wfile))
                master = read_range(ctx.tag_dir / loc.file, loc.data_offset + loc.element_offset * 4, n * 4)
                saved = read_range(ctx.tag_dir / wfile, base + first * ref.storage.itemsize, n * ref.storage.itemsize)
            except (CkptspecError, OSError, ValueError):
                continue  # unreadable or damaged files are the other checks' findings
            if len(master) == n * 4 and saved != ROUND[dtype](master):
                reported.add(wfile)
                yield finding(
                    "CK235",
                    json_path("domains", i),
                    f"{loc.param} (elements {first}..{first + n - 1}) saved in {wfile} is not its fp32 master in "
                    f"{loc.file} rounded to {dtype}",
                    "a layer file of another layer, run or save (swapped files?): restore the files of one save, "
                    "each under its own name",
                    file=wfile,
                )


def _model_file(domain) -> str | None:
    return next((f.path for f in domain.manifest.files if f.role == "model_states"), None)


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
        first: dict[str, MasterLocator] = {}
        for loc in domain.masters.tensors:
            first.setdefault(loc.param, loc)  # a master's first piece starts at its element 0
        wrong: dict[tuple[str, str], list[tuple[str, int, MasterLocator, str]]] = {}
        compared: dict[str, set[str]] = {}  # weights file -> the masters files it was compared with
        for name, loc in first.items():
            held = weights.get(name)
            if held is None or not isinstance(held[1], TensorRef) or loc.dtype != "float32":
                continue
            wfile, ref = held
            n = min(SAMPLE, loc.numel, ref.numel)
            if ref.dtype not in ROUND or not n or not ref.is_contiguous():
                continue
            try:
                base, _ = tensor_byte_range(ref, ctx.states.members(ctx.tag_dir / wfile))
                master = read_range(ctx.tag_dir / loc.file, loc.data_offset + loc.element_offset * 4, n * 4)
                saved = read_range(ctx.tag_dir / wfile, base, n * ref.storage.itemsize)
            except (CkptspecError, OSError, ValueError):
                continue  # unreadable or damaged files are the other checks' findings
            if len(master) != n * 4:
                continue
            compared.setdefault(wfile, set()).add(loc.file)
            if saved != ROUND[ref.dtype](master):
                wrong.setdefault((wfile, loc.file), []).append((name, n, loc, ref.dtype))
        for wfile, mfiles in compared.items():  # a weights file apart from its masters, wrong against all of them
            if wfile in mfiles or any((wfile, m) not in wrong for m in mfiles):
                continue
            found = [hit for m in sorted(mfiles) for hit in wrong.pop((wfile, m))]
            name, n, loc, dtype = found[0]
            others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            yield finding(
                "CK235",
                json_path("domains", i, "masters"),
                f"{name} (elements 0..{n - 1}) saved in {wfile} is not its fp32 master in {loc.file} "
                f"({'/'.join(map(str, loc.key))}) rounded to {dtype}{others}; no master in "
                f"{', '.join(sorted(mfiles))} is",
                "a module or expert file of another run, seed, dtype or save: restore the files of one save, each "
                "under its own name",
                file=wfile,
                rank=domain.file_ranks.get(wfile),
            )
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

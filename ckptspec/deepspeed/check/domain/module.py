"""CK215-CK220: the saved ``module`` (and frozen fragments) against the manifest's names, shapes,
flat offsets, slice mappings and ties."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import compress, repeat
from operator import attrgetter
from typing import Any

from ....checkpoint.torchfile import TensorRef
from ....findings import Finding, RuleSet, finding, json_path
from ....format.models import Manifest, Param
from ....format.partition import natural_order
from ...layout.ties import repeated
from .context import Check, Context

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register
_STORAGE_KEY = attrgetter("storage.key")
_VIEW = attrgetter("storage.key", "storage_offset", "shape", "stride")  # one tensor, as torch saves views


@check("CK215")
def module_role(ctx: Context) -> Iterator[Finding]:
    """Every 'module' key has exactly one role (trainable, frozen, alias, buffer), so nothing is silently dropped."""
    excluded = {e.name for e in ctx.manifest.excluded if ctx.names[e.name][0] == "excluded"}
    declared = ctx.names.keys() - excluded  # in C, as the differences below (a million names at 1M tensors)
    for f, module in ctx.modules():
        roleless = module.keys() - declared  # almost always empty
        for key in module if roleless else ():
            if key in roleless:
                role = ctx.names.get(key, (None,))[0]
                why = "is declared excluded" if role == "excluded" else "has no role in the manifest"
                yield finding(
                    "CK215",
                    json_path(),
                    f"module key {key!r} {why} (not trainable, frozen, alias or buffer)",
                    "a reconstruction would silently drop this tensor; zero_to_fp32 drops it too. Is a tie "
                    "(shared_params) or frozen_param_shapes missing?",
                    file=f.name,
                    rank=f.rank,
                )
        missing = declared - module.keys()
        for name, (role, _, _) in ctx.names.items() if missing else ():
            if name in missing:
                yield finding(
                    "CK215",
                    ctx.name_path(name),
                    f"{role} {name!r} is declared but not in the saved module",
                    "the manifest describes a different model than this checkpoint",
                    file=f.name,
                    rank=f.rank,
                )


@check("CK216")
def module_shape(ctx: Context) -> Iterator[Finding]:
    """The saved module tensors have the recorded shapes (catches a transposed shape in param_shapes)."""
    stage3 = ctx.layout.zero_stage == 3
    expected: dict[str, tuple[tuple[int, ...], str | None]] = {}  # a reader's shapes are tuples
    if not stage3:  # stage 3 saves (0,) placeholders for every parameter
        for grp in ctx.manifest.groups:
            for p in grp.params:
                expected[p.name] = (tuple(p.shape), p.dtype)
        for fr in ctx.manifest.frozen:
            expected[fr.name] = (tuple(fr.shape), None)
        for a in ctx.manifest.aliases:
            expected[a.name] = (tuple(a.shape), None)
    for b in ctx.manifest.buffers:
        expected[b.name] = (tuple(b.shape), b.dtype)
    for f, module in ctx.modules():
        get = module.get
        for name, (shape, dtype) in expected.items():
            ref = get(name)
            if not isinstance(ref, TensorRef):
                continue  # CK215 reports missing keys
            if ref.shape != shape and list(ref.shape) != list(shape):
                yield finding(
                    "CK216",
                    ctx.name_path(name, "shape"),
                    f"{name}: the saved tensor has shape {list(ref.shape)}, the manifest records {list(shape)}",
                    "param_shapes (or the manifest) records a wrong shape; a reconstruction would return a wrongly "
                    "shaped tensor",
                    file=f.name,
                    rank=f.rank,
                )
            elif dtype is not None and ref.dtype != dtype:
                yield finding(
                    "CK216",
                    ctx.name_path(name, "dtype"),
                    f"{name}: the saved tensor is {ref.dtype}, the manifest records {dtype}",
                    "the manifest describes a different run",
                    file=f.name,
                    rank=f.rank,
                )


@check("CK217")
def module_layout(ctx: Context) -> Iterator[Finding]:
    """Stage 1/2 save the module's trainable tensors as views into the flat buffer: their offsets are the real layout.

    Catches reordered param_shapes (and a wrong round-robin order). Groups whose tensors
    do not share a storage (not a flat-view save) are skipped.
    """
    if ctx.layout.zero_stage == 3:
        return
    for f, module in ctx.modules():
        for g, grp in enumerate(ctx.manifest.groups):
            found = [(j, p, module.get(p.name)) for j, p in enumerate(grp.params)]
            refs: list[tuple[int, Param, TensorRef]] = [
                (j, p, r)
                for j, p, r in found
                if isinstance(r, TensorRef) and 0 not in r.shape  # elements
            ]
            counts = Counter(map(_STORAGE_KEY, (r for _, _, r in refs)))
            flat_key, most = counts.most_common(1)[0] if counts else (None, 0)
            if most < 2:
                continue
            flat_numel = next(r.storage.numel for _, _, r in refs if r.storage.key == flat_key)
            if flat_numel != grp.padded_numel:
                yield finding(
                    "CK217",
                    json_path("groups", g, "padded_numel"),
                    f"group {g}: the module's flat buffer holds {flat_numel} elements, the manifest's padded group "
                    f"{grp.padded_numel}",
                    "param_shapes does not describe this flat buffer (wrong shapes, paddings or world size)",
                    file=f.name,
                    rank=f.rank,
                )
            autotp = ctx.layout.tensor_parallel_size > 1
            for j, p, r in refs:
                if r.storage.key != flat_key:
                    if autotp:
                        continue  # AutoTP replaces its sharded layers' tensors: only the replicated ones stay views
                    yield finding(
                        "CK217",
                        json_path("groups", g, "params", j),
                        f"{p.name} is not a view into group {g}'s flat buffer",
                        "the module tensors do not come from this group",
                        file=f.name,
                        rank=f.rank,
                    )
                elif r.storage_offset != p.offset or not r.is_contiguous():
                    yield finding(
                        "CK217",
                        json_path("groups", g, "params", j, "offset"),
                        f"{p.name} sits at element {r.storage_offset} of group {g}'s flat buffer, the manifest "
                        f"says {p.offset}",
                        "the recorded parameter order or paddings differ from the real flat layout; a reconstruction "
                        "would return other parameters' values under these names",
                        file=f.name,
                        rank=f.rank,
                    )


def expected_slice_mappings(manifest: Manifest, g: int, rank: int) -> list[tuple[str, int, int]]:
    """``param_slice_mappings[g]`` as DeepSpeed 0.19 writes it for ``rank``: (name, numel, start).

    DeepSpeed walks the params in their natural (optimizer) order. Without alignment
    paddings it counts offsets sequentially in that order, so for round-robin checkpoints
    the mappings do not describe the flat buffer (docs/validation.md); with paddings it uses the
    real offsets.
    """
    grp = manifest.groups[g]
    start, end = rank * grp.partition_numel, (rank + 1) * grp.partition_numel
    params = list(grp.params)
    if manifest.layout.round_robin:
        params = natural_order(params, grp.partition_count)
    real_offsets = any(p.padding for p in grp.params) or not manifest.layout.round_robin
    out, cursor = [], 0
    for p in params:
        offset = p.offset if real_offsets else cursor
        p_end = offset + p.numel
        if p.numel > 0 and (start <= offset < end or offset < start < p_end):
            lo, hi = max(offset, start), min(p_end, end)
            out.append((p.name, hi - lo, lo - start))
        cursor += p.numel
    return out


@check("CK218")
def slice_mappings(ctx: Context) -> Iterator[Finding]:
    """Each rank's param_slice_mappings agree with the recorded order and offsets (stage 1/2).

    Round robin: DeepSpeed computes the mappings over the natural parameter order, so they
    are compared with that (they then disagree with the flat buffer; see docs/validation.md).
    """
    if ctx.layout.zero_stage == 3:
        return
    for f, osd in ctx.optim_files():
        mappings = osd.get("param_slice_mappings")
        if mappings is None or f.rank is None or f.rank >= ctx.world_size:
            continue
        if not isinstance(mappings, list) or len(mappings) != len(ctx.manifest.groups):
            n = len(mappings) if isinstance(mappings, list) else type(mappings).__name__
            yield finding(
                "CK218",
                json_path("groups"),
                f"param_slice_mappings has {n} groups, the manifest {len(ctx.manifest.groups)}",
                "the file belongs to another run or layout",
                file=f.name,
                rank=f.rank,
            )
            continue
        for g, mapping in enumerate(mappings):
            if f.rank >= ctx.manifest.groups[g].partition_count:
                continue
            actual = []
            for name, addr in mapping.items() if isinstance(mapping, dict) else []:
                actual.append((str(name), getattr(addr, "numel", None), getattr(addr, "start", None)))
            expected = expected_slice_mappings(ctx.manifest, g, f.rank)
            if actual != expected:
                yield finding(
                    "CK218",
                    json_path("groups", g, "params"),
                    f"group {g}: param_slice_mappings " + _mapping_difference(actual, expected),
                    "the recorded parameter order or offsets differ from the file's own mapping; a reconstruction "
                    "(or ds_to_universal) would read the wrong slices",
                    file=f.name,
                    rank=f.rank,
                )


def _mapping_difference(actual: list, expected: list) -> str:
    for a, e in zip(actual, expected):
        if a != e:
            return (
                f"has {a[0]} (numel {a[1]}, start {a[2]}) where the manifest implies "
                f"{e[0]} (numel {e[1]}, start {e[2]})"
            )
    if len(actual) > len(expected):
        return f"has extra entry {actual[len(expected)][0]}"
    return f"lacks {expected[len(actual)][0]} (numel {expected[len(actual)][1]}, start {expected[len(actual)][2]})"


@check("CK219")
def alias_tie(ctx: Context) -> Iterator[Finding]:
    """An alias's owner exists and the saved tensors really are one tensor; no tie goes undeclared."""
    stage3 = ctx.layout.zero_stage == 3
    owners = {a.name: a.owner for a in ctx.manifest.aliases}
    for f, module in ctx.modules():
        for i, a in enumerate(ctx.manifest.aliases):
            ref, owner = module.get(a.name), module.get(a.owner)
            if a.owner not in ctx.names or ctx.names[a.owner][0] in ("alias", "excluded"):
                yield finding(
                    "CK219",
                    json_path("aliases", i, "owner"),
                    f"alias {a.name!r} points to {a.owner!r}, which is not a parameter or buffer of the checkpoint",
                    "the tie cannot be restored; check shared_params",
                    file=f.name,
                    rank=f.rank,
                )
            elif not isinstance(owner, TensorRef):
                yield finding(
                    "CK219",
                    json_path("aliases", i, "owner"),
                    f"alias {a.name!r}: its owner {a.owner!r} is not in the saved module",
                    "the tie cannot be restored; check shared_params",
                    file=f.name,
                    rank=f.rank,
                )
            elif not stage3 and isinstance(ref, TensorRef) and ref.numel > 0 and _VIEW(ref) != _VIEW(owner):
                # (Stage 3 placeholders of tied params share a storage only as DeepSpeed saved them; a
                # re-save by torch splits empty storages, so a missing share is no evidence there.)
                yield finding(
                    "CK219",
                    json_path("aliases", i, "owner"),
                    f"alias {a.name!r} is not the same tensor as its owner {a.owner!r} in the saved module",
                    "shared_params names the wrong owner; a reconstruction would copy another tensor's values",
                    file=f.name,
                    rank=f.rank,
                )
        # Undeclared ties: tensors that are one tensor in the module but not declared aliases.
        view = _STORAGE_KEY if stage3 else _VIEW
        seen: dict[Any, str] = {}
        for name, ref in _sharing_a_view(module, view):
            if ctx.names.get(name, _PARAM)[0] not in _PARAM_ROLES or (not stage3 and 0 in ref.shape):
                continue  # (0 in shape: no elements)
            first = seen.setdefault(view(ref), name)
            if first != name and owners.get(name, name) != owners.get(first, first):
                yield finding(
                    "CK219",
                    json_path("aliases"),
                    f"{name!r} is the same tensor as {first!r} in the saved module, but no alias declares the tie",
                    f"declare {name!r} an alias of {first!r} (was shared_params emptied?)",
                    file=f.name,
                    rank=f.rank,
                )


_PARAM = ("trainable",)  # a module key the manifest does not name counts as a parameter here
_PARAM_ROLES = ("trainable", "frozen", "alias")


def _sharing_a_view(module: dict, view) -> Iterator[tuple[str, TensorRef]]:
    """The (name, tensor) entries of ``module`` whose ``view`` another tensor of it has too, in
    order: the only ones that can be a tie (a million entries in a 1M-tensor model, too many for a
    Python loop over them all)."""
    names, refs = list(module), list(module.values())
    tensors = list(map(isinstance, refs, repeat(TensorRef)))
    names, refs = list(compress(names, tensors)), list(compress(refs, tensors))
    return repeated(zip(names, refs), map(view, refs))


@check("CK220")
def frozen_fragments(ctx: Context) -> Iterator[Finding]:
    """Frozen parameters are saved where the manifest says: full fragments (stage 2), a partition per rank (stage 3)."""
    ws = ctx.world_size
    for f, state in ctx.model_files():
        fragments = state.get("frozen_param_fragments")
        fragments = fragments if isinstance(fragments, dict) else {}
        for i, fr in enumerate(ctx.manifest.frozen):
            if fr.stored_in == "module":
                continue
            ref = fragments.get(fr.name)
            path = json_path("frozen", i)
            if not isinstance(ref, TensorRef):
                yield finding(
                    "CK220",
                    path,
                    f"frozen parameter {fr.name!r} has no fragment in frozen_param_fragments",
                    "the frozen weight is not in this file; a reconstruction would fail or drop it",
                    file=f.name,
                    rank=f.rank,
                )
                continue
            if fr.stored_in == "partitioned_fragments":
                share = -(-fr.numel // ws)
                if ref.numel != share or len(ref.shape) != 1:
                    yield finding(
                        "CK220",
                        path,
                        f"frozen {fr.name!r}: this rank's fragment has shape {list(ref.shape)}, "
                        f"ceil({fr.numel} / {ws}) gives ({share},)",
                        "the fragment belongs to another run or layout",
                        file=f.name,
                        rank=f.rank,
                    )
            elif list(ref.shape) != list(fr.shape):
                yield finding(
                    "CK220",
                    path + ".shape",
                    f"frozen {fr.name!r}: the fragment has shape {list(ref.shape)}, the manifest records "
                    f"{list(fr.shape)}",
                    "the fragment belongs to another run, or the manifest is wrong",
                    file=f.name,
                    rank=f.rank,
                )
            if ref.dtype != fr.dtype:
                yield finding(
                    "CK220",
                    path + ".dtype",
                    f"frozen {fr.name!r}: the fragment is {ref.dtype}, the manifest records {fr.dtype}",
                    "the fragment belongs to another run",
                    file=f.name,
                    rank=f.rank,
                )

"""CK213-CK214: the flat master partitions hold what the manifest's arithmetic and locators say."""

from __future__ import annotations

from collections.abc import Iterator

from ....checkpoint.torchfile import TensorRef
from ....findings import Finding, RuleSet, finding, json_path
from .context import Check, Context

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register


@check("CK213")
def partition_numel(ctx: Context) -> Iterator[Finding]:
    """Each rank's flat master partition holds exactly the manifest's saved numel.

    Stage 1/2: the group padded to 2 x world size, split evenly, tail padding stripped
    (BF16_Optimizer keeps it); stage 3: ceil(numel / ws) per param, summed per sub-group,
    identical on every rank.
    """
    master = ctx.layout.master_dtype
    for f, osd in ctx.optim_files():
        flat = osd.get(ctx.flat_key)
        if not isinstance(flat, list) or f.rank is None:
            continue
        for g, (ref, grp) in enumerate(zip(flat, ctx.manifest.groups)):
            path = (
                json_path("groups", g, "saved_numels", f.rank)
                if f.rank < len(grp.saved_numels)
                else json_path("groups", g)
            )
            if not isinstance(ref, TensorRef):
                yield finding(
                    "CK213", path, f"{ctx.flat_key}[{g}] is not a tensor", "restore the file", file=f.name, rank=f.rank
                )
                continue
            expected = grp.saved_numels[f.rank] if f.rank < len(grp.saved_numels) else None
            if len(ref.shape) != 1 or ref.numel != expected:
                rule = (
                    "ceil(numel / world size) per param"
                    if grp.partitioning == "per_param"
                    else f"the group padded to {grp.alignment} and split {grp.partition_count} ways"
                )
                yield finding(
                    "CK213",
                    path,
                    f"group {g}: the flat partition holds {ref.numel} elements (shape {list(ref.shape)}), "
                    f"the manifest arithmetic ({rule}) gives {expected}",
                    "the file belongs to another run or layout, or param_shapes is corrupt; a reconstruction would "
                    "shift weights",
                    file=f.name,
                    rank=f.rank,
                )
            if ref.dtype != master:
                yield finding(
                    "CK213",
                    json_path("layout", "master_dtype"),
                    f"group {g}: the flat partition is {ref.dtype}, the manifest's master dtype is {master}",
                    "the file belongs to another run or layout",
                    file=f.name,
                    rank=f.rank,
                )


@check("CK214")
def partition_locator(ctx: Context) -> Iterator[Finding]:
    """The manifest's byte locators point at the flat partitions' real bytes."""
    for f, osd in ctx.optim_files():
        flat = osd.get(ctx.flat_key)
        members = (f.loaded.members if f.loaded is not None else None) or {}
        if not isinstance(flat, list):
            continue
        for k, loc in enumerate(f.entry.partitions):
            ref = flat[loc.group] if loc.group < len(flat) else None
            if not isinstance(ref, TensorRef):
                continue
            real = (
                ref.storage.member,
                *members.get(ref.storage.member, (None, None)),
                ref.dtype,
                ref.storage_offset,
                ref.numel,
            )
            recorded = (loc.member, loc.data_offset, loc.member_size, loc.dtype, loc.element_offset, loc.numel)
            if real != recorded or loc.rank != f.rank:
                fields = ("member", "data_offset", "member_size", "dtype", "element_offset", "numel")
                diff = ", ".join(f"{n} {r!r} (manifest {m!r})" for n, r, m in zip(fields, real, recorded) if r != m)
                yield finding(
                    "CK214",
                    f.at("partitions", k),
                    f"group {loc.group}: the locator does not match the partition in the file: "
                    f"{diff or f'rank {loc.rank}'}",
                    "a reader following this locator would read the wrong bytes; regenerate the manifest or "
                    "restore the file",
                    file=f.name,
                    rank=f.rank,
                )

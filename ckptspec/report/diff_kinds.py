"""``diff`` across document kinds: a checkpoint index against a manifest 1.x or another index.

Pure computation, like ``diff.py``. Both sides become a ``View``: the parallel degrees, the
optimizer's partition domains (each a 1.x manifest; a plain ZeRO manifest is the one ``dense``
domain that a stage-0, MoE or universal index also names so) and the whole model's tensors by
name. They are then compared as two manifests are: the whole model's names, shapes, roles and
dtypes, the degrees, each domain's layout and flat groups, and the resume rules (CK501-CK510).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..findings import Finding, finding, json_path
from ..format.index_models import CheckpointIndex
from ..format.models import Manifest
from . import diff
from .diff import Change, Diff, Tensor, tensors

DENSE = "dense"  # the domain id of a data-parallel group at pipeline 1 x tensor 1 (describe/index_builder.py)
WHOLE_MODEL_CODES = ("CK504", "CK505", "CK506")  # rules on names, shapes and roles


@dataclass(frozen=True)
class View:
    """One side of a diff, whatever its document."""

    kind: str  # "zero" (a manifest, or an index of ZeRO files) or "universal"
    degrees: dict[str, int]
    domains: dict[str, tuple[str, Manifest]]  # id -> (JSON path of its manifest, the manifest)
    tensors: dict[str, Tensor]
    complete: bool  # frozen parameters, buffers and ties are among ``tensors``


def view_of(document: Manifest | CheckpointIndex) -> View:
    if isinstance(document, Manifest):
        layout = document.layout
        degrees = {"pipeline": layout.pipeline_parallel_size or 1, "tensor": layout.tensor_parallel_size or 1}
        return View("zero", degrees, {DENSE: ("$", document)}, tensors(document), True)
    degrees = document.topology.degrees.model_dump(exclude_unset=True)
    degrees.pop("data", None)  # each domain's world size is compared with its manifest
    whole = {
        p.name: Tensor(p.name, "trainable", json_path("parameters", k), tuple(p.shape), p.dtype)
        for k, p in enumerate(document.parameters)
    }
    # At pipeline 1 x tensor 1 the domains' names are the whole model's names, so their frozen
    # parameters, buffers and ties are the model's too; at other degrees they are a stage's or a slice's.
    complete = degrees["pipeline"] == degrees["tensor"] == 1
    domains = {}
    for k, d in enumerate(document.domains):
        where = json_path("domains", k, "manifest")
        domains[d.id] = (where, _as_configured(d))
        if complete:
            for name, t in tensors(d.manifest).items():
                if t.role != "trainable" and name not in whole:
                    whole[name] = dataclasses.replace(t, path=where + t.path[1:])
    return View(document.kind, degrees, domains, whole, complete)


# Where a stage-0 domain's masters are tells which DeepSpeed wrapper saved its optimizer state
# (deepspeed/masters.py): the state dict a job loads is that wrapper's own.
_STAGE0_WRAPPERS = {"fp32_groups_flat": "FP16_Optimizer", "fp32_groups": "FP16_UnfusedOptimizer"}


def _stage0_wrapper(domain) -> str | None:
    if domain.masters is None or not domain.masters.tensors:
        return None
    key = domain.masters.tensors[0].key
    return _STAGE0_WRAPPERS.get(key[1]) if len(key) > 1 and key[0] == "optimizer" else None


def _as_configured(domain) -> Manifest:
    """The domain's manifest with the ZeRO stage and world size its job ran with: a domain whose
    masters the index locates (stage 0, MoE, universal) describes them as stage-0 groups of its
    own, and keeps the configured stage in ``configured_zero_stage``; at stage 0 the optimizer
    wrapper its masters show, where its layout records none."""
    configured = domain.configured_zero_stage
    layout = domain.manifest.layout
    update = {}
    if configured is not None and (configured, domain.size) != (layout.zero_stage, layout.world_size):
        update = {"zero_stage": configured, "world_size": domain.size}
    if configured == 0 and layout.optimizer is None and (wrapper := _stage0_wrapper(domain)) is not None:
        update["optimizer"] = wrapper
    if not update:
        return domain.manifest
    return domain.manifest.model_copy(update={"layout": layout.model_copy(update=update)})


def _comparable(va: View, vb: View) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The two tensor tables, restricted to what both sides can tell (trainable names only when
    one side does not list its frozen parameters, buffers and ties)."""
    if va.complete and vb.complete:
        return va.tensors, vb.tensors
    only = lambda ts: {n: t for n, t in ts.items() if t.role == "trainable"}  # noqa: E731
    return only(va.tensors), only(vb.tensors)


def _moved(change: Change, where: str) -> Change:
    return dataclasses.replace(change, path=where + change.path[1:])


def changes(va: View, vb: View) -> list[Change]:
    out = []
    if va.kind != vb.kind:
        out.append(Change("kind", "$.kind", va.kind, vb.kind))
    for axis in sorted(set(va.degrees) | set(vb.degrees)):
        a, b = va.degrees.get(axis, 1), vb.degrees.get(axis, 1)
        if a != b:
            out.append(Change("degrees", json_path("topology", "degrees", axis), a, b, axis))
    out += [Change("domain-removed", "$", d, None, d) for d in va.domains if d not in vb.domains]
    out += [Change("domain-added", vb.domains[d][0], None, d, d) for d in vb.domains if d not in va.domains]
    for d, (where, mb) in vb.domains.items():
        if d in va.domains:
            ma = va.domains[d][1]
            out += [_moved(c, where) for c in diff.layout_changes(ma, mb) + diff.group_changes(ma, mb)]
    ta, tb = _comparable(va, vb)
    return out + diff.tensor_changes(ta, tb)


# --------------------------------------------------------------------------- resume rules across kinds


def _degrees_reason(va: View, vb: View) -> Finding | None:
    (pa, ta), (pb, tb) = (va.degrees["pipeline"], va.degrees["tensor"]), (vb.degrees["pipeline"], vb.degrees["tensor"])
    if (pa, ta) == (pb, tb):
        return None
    return finding(
        "CK508",
        "$.topology.degrees",
        f"A was saved at pipeline {pa} x tensor {ta}, B runs pipeline {pb} x tensor {tb}",
        "DeepSpeed loads ZeRO optimizer partitions only at the degrees they were saved at: convert A with "
        "ds_to_universal and load it with checkpoint.load_universal (the weights alone: ckptspec reconstruct)",
    )


def _universal_reason(va: View) -> Finding | None:
    if va.kind != "universal":
        return None
    return finding(
        "CK509",
        "$.kind",
        "A is a universal checkpoint (ds_to_universal's folder): it has no ZeRO optimizer files, so a job "
        "with DeepSpeed's default configuration cannot load it",
        "set checkpoint.load_universal: true in B's DeepSpeed config; then only the names and shapes must "
        "match (the reasons below, if any)",
    )


def _domains_reason(va: View, vb: View) -> Finding | None:
    if set(va.domains) == set(vb.domains):
        return None
    show = lambda v: ", ".join(sorted(v.domains))  # noqa: E731
    return finding(
        "CK510",
        "$.domains",
        f"A's optimizer state is partitioned over the domains [{show(va)}], B's over [{show(vb)}]",
        "resume with the parallel layout (ZeRO stage 0 or not, MoE expert-parallel size) A was saved with",
    )


# ``ckptspec reshard`` rewrites plain data-parallel ZeRO checkpoints only (docs/reshard.md): where one
# side is an index, the 1.x rules' hints name what works instead of a command that would refuse it.
_NOT_RESHARD = "(ckptspec reshard rewrites plain data-parallel ZeRO checkpoints only)"
_INDEX_HINTS = {
    "CK501": "resume on A's number of data-parallel ranks; DeepSpeed's way across world sizes is ds_to_universal "
    f"and checkpoint.load_universal {_NOT_RESHARD}",
    "CK502": "resume with A's ZeRO stage (stages 1 and 2 are interchangeable); DeepSpeed's way across stages 1-3 "
    f"is ds_to_universal and checkpoint.load_universal {_NOT_RESHARD}",
}


def _for_an_index(reason: Finding, where: str) -> Finding:
    hint = _INDEX_HINTS.get(reason.code, reason.hint) if "ckptspec reshard" in reason.hint else reason.hint
    return dataclasses.replace(reason, path=where + reason.path[1:], hint=hint)


def resume_reasons(a: Manifest | CheckpointIndex, b: Manifest | CheckpointIndex) -> list[Finding]:
    """Why a job laid out like B cannot load A's optimizer state, for documents of any kind."""
    return _resume_reasons(view_of(a), view_of(b))


def _resume_reasons(va: View, vb: View) -> list[Finding]:
    if (degrees := _degrees_reason(va, vb)) is not None:
        return [degrees]  # nothing else of A loads at other degrees
    reasons = [r for r in (_universal_reason(va),) if r is not None]
    ta, tb = _comparable(va, vb)
    # A universal folder is loaded by name into any data-parallel layout: it records frozen parameters
    # as it records the trainable ones, and a job with load_universal takes each as its own model has
    # it (no CK506), whatever the layout rules say.
    universal = "universal" in (va.kind, vb.kind)
    whole_codes = ("CK504", "CK505") if universal else WHOLE_MODEL_CODES
    whole = [f for rule in diff.RULES if rule.code in whole_codes for f in rule.check(None, None, ta, tb)]
    reasons += whole
    if universal:
        return reasons
    if (domains := _domains_reason(va, vb)) is not None:
        return reasons or [domains]  # different names already explain different domains
    both_complete = va.complete and vb.complete
    for d, (where, mb) in vb.domains.items():
        for reason in diff.resume_reasons(va.domains[d][1], mb):
            # The whole model's names were compared above: a domain's own names add to them only
            # where the domains name what the whole-model table leaves out (a stage's or a slice's).
            if reason.code in WHOLE_MODEL_CODES and (both_complete or whole):
                continue
            if reason.code == "CK507" and any(r.code in diff.ROOT_CAUSES for r in reasons):
                continue
            reasons.append(_for_an_index(reason, where))
    return reasons


@dataclass
class KindsDiff(Diff):
    """A ``Diff`` of which one side at least is a checkpoint index: with both sides' degrees."""

    degrees: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "degrees": self.degrees}


def diff_any(a: Manifest | CheckpointIndex, b: Manifest | CheckpointIndex) -> KindsDiff:
    """Changes from A to B and the reasons B cannot resume from A (either may be an index)."""
    va, vb = view_of(a), view_of(b)
    return KindsDiff(changes(va, vb), _resume_reasons(va, vb), {"a": va.degrees, "b": vb.degrees})


__all__ = ["View", "KindsDiff", "view_of", "changes", "resume_reasons", "diff_any", "DENSE"]

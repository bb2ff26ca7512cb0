"""What changed between two manifests, and whether B's layout can resume from A's state.

Pure computation: two validated ``Manifest`` objects in, a ``Diff`` out (rendering
lives in ``ckptspec.cli.render``). "Resume" means what ``engine.load_checkpoint(dir)``
does with its defaults in DeepSpeed 0.19.8 (strict module load, optimizer states
loaded, fp32 masters taken from the checkpoint) when the job is configured like B
and the checkpoint is A. Each rule that blocks it is one function and one code
(CK501-CK507, docs/errors.md; CK508-CK510 across document kinds: ``diff_kinds.py``);
``tests/report/test_diff.py`` checks the verdicts against real DeepSpeed runs
(``tests/_harness/job/resume.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..findings import Finding, RuleSet, finding, json_path
from ..format.models import Manifest

DIFF_VERSION = "1.0"
LAYOUT_FIELDS = (
    "zero_stage",
    "world_size",
    "model_dtype",
    "master_dtype",
    "optimizer",
    "round_robin",
    "parameter_alignment",
    "sub_group_size",
    "tail_padding_saved",
    "exclude_frozen_parameters",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)
GROUP_FIELDS = ("optimizer_group", "partitioning", "partition_count", "alignment", "padded_numel", "partition_numel")
MAX_NAMES = 5  # names listed in one message


@dataclass(frozen=True)
class Tensor:
    """One name of the model as a manifest records it."""

    name: str
    role: str  # trainable | frozen | alias | buffer | excluded
    path: str
    shape: tuple[int, ...] | None = None  # None: unknown (excluded)
    dtype: str | None = None
    group: int | None = None  # manifest group index (trainable)
    optimizer_group: int | None = None
    owner: str | None = None  # alias

    @property
    def saved(self) -> bool:
        """In the checkpoint's ``module`` state dict (excluded frozen parameters are not)."""
        return self.role != "excluded"


@dataclass(frozen=True)
class Change:
    kind: str
    path: str  # where it shows: B's manifest, or A's for what B lacks
    a: Any = None
    b: Any = None
    name: str | None = None
    role: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "path": self.path, "a": self.a, "b": self.b}
        if self.name is not None:
            out["name"] = self.name
        if self.role is not None:
            out["role"] = self.role
        return out


@dataclass
class Diff:
    changes: list[Change] = field(default_factory=list)
    reasons: list[Finding] = field(default_factory=list)  # what stops B from resuming from A

    @property
    def resumable(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "diff_version": DIFF_VERSION,
            "identical": not self.changes,
            "changes": [c.to_dict() for c in self.changes],
            "resume": {"ok": self.resumable, "reasons": [r.to_dict() for r in self.reasons]},
        }


# --------------------------------------------------------------------------- tensors by name


def tensors(manifest: Manifest) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for g, group in enumerate(manifest.groups):
        for k, p in enumerate(group.params):
            out[p.name] = Tensor(
                p.name,
                "trainable",
                json_path("groups", g, "params", k),
                tuple(p.shape),
                p.dtype,
                g,
                group.optimizer_group,
            )
    for k, f in enumerate(manifest.frozen):
        out.setdefault(f.name, Tensor(f.name, "frozen", json_path("frozen", k), tuple(f.shape), f.dtype))
    for k, a in enumerate(manifest.aliases):
        out.setdefault(a.name, Tensor(a.name, "alias", json_path("aliases", k), tuple(a.shape), owner=a.owner))
    for k, b in enumerate(manifest.buffers):
        out.setdefault(b.name, Tensor(b.name, "buffer", json_path("buffers", k), tuple(b.shape), b.dtype))
    for k, e in enumerate(manifest.excluded):
        out.setdefault(e.name, Tensor(e.name, "excluded", json_path("excluded", k)))
    return out


def _shape(t: Tensor) -> list[int] | None:
    return None if t.shape is None else list(t.shape)


def _role_change(a: Tensor, b: Tensor) -> str:
    pair = (a.role, b.role)
    return {
        ("trainable", "frozen"): "frozen",
        ("frozen", "trainable"): "unfrozen",
        ("trainable", "alias"): "tied",
        ("alias", "trainable"): "untied",
    }.get(pair, "role")


def tensor_changes(ta: dict[str, Tensor], tb: dict[str, Tensor]) -> list[Change]:
    out = []
    for name, b in tb.items():
        a = ta.get(name)
        if a is None:
            out.append(Change("added", b.path, None, _shape(b), name, b.role))
            continue
        if a.role != b.role:
            out.append(Change(_role_change(a, b), b.path, a.role, b.role, name, b.role))
        if a.shape is not None and b.shape is not None and a.shape != b.shape:
            out.append(Change("reshaped", b.path + ".shape", _shape(a), _shape(b), name, b.role))
        if a.dtype is not None and b.dtype is not None and a.dtype != b.dtype:
            out.append(Change("retyped", b.path + ".dtype", a.dtype, b.dtype, name, b.role))
        if a.role == b.role == "trainable" and a.optimizer_group != b.optimizer_group:
            out.append(Change("moved", b.path, a.optimizer_group, b.optimizer_group, name, b.role))
        if a.role == b.role == "alias" and a.owner != b.owner:
            out.append(Change("alias-owner", b.path + ".owner", a.owner, b.owner, name, b.role))
    out += [Change("removed", a.path, _shape(a), None, name, a.role) for name, a in ta.items() if name not in tb]
    return out


def layout_changes(a: Manifest, b: Manifest) -> list[Change]:
    out = []
    for f in LAYOUT_FIELDS:
        va, vb = getattr(a.layout, f), getattr(b.layout, f)
        # An OPTIONAL field only one side records is unknown on the other, not changed.
        if va != vb and va is not None and vb is not None:
            out.append(Change("layout", json_path("layout", f), va, vb, f))
    return out


def _param_layout(group) -> list[tuple]:
    return [(p.name, tuple(p.shape), p.offset, p.padding) for p in group.params]


def _first_param_difference(ga, gb, g: int) -> Change | None:
    la, lb = _param_layout(ga), _param_layout(gb)
    for k in range(max(len(la), len(lb))):
        pa = la[k] if k < len(la) else None
        pb = lb[k] if k < len(lb) else None
        if pa != pb:
            show = lambda p: None if p is None else {"name": p[0], "shape": list(p[1]), "offset": p[2], "padding": p[3]}  # noqa: E731
            return Change("group-params", json_path("groups", g, "params", k), show(pa), show(pb))
    return None


def group_changes(a: Manifest, b: Manifest) -> list[Change]:
    out = []
    if len(a.groups) != len(b.groups):
        out.append(Change("group-count", json_path("groups"), len(a.groups), len(b.groups)))
    for g, (ga, gb) in enumerate(zip(a.groups, b.groups)):
        out += [
            Change("group", json_path("groups", g, f), getattr(ga, f), getattr(gb, f), f)
            for f in GROUP_FIELDS
            if getattr(ga, f) != getattr(gb, f)
        ]
        if (first := _first_param_difference(ga, gb, g)) is not None:
            out.append(first)
    return out


# --------------------------------------------------------------------------- resume rules

RULES: RuleSet[Callable[..., Iterator[Finding]]] = RuleSet()
rule = RULES.register


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_NAMES])
    return shown + (f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else "")


def _partitioned(m: Manifest) -> bool:
    return m.layout.zero_stage >= 1


@rule("CK501")
def resume_world_size(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    """engine._load_zero_checkpoint raises ZeRORuntimeException when the DP world size differs."""
    if _partitioned(a) and _partitioned(b) and a.layout.world_size != b.layout.world_size:
        yield finding(
            "CK501",
            json_path("layout", "world_size"),
            f"the data-parallel world size changes from {a.layout.world_size} to {b.layout.world_size}; "
            "DeepSpeed refuses ZeRO optimizer state saved at another world size",
            f"resume on {a.layout.world_size} ranks, or rewrite the checkpoint for {b.layout.world_size}: "
            f"`ckptspec reshard A OUTPUT --world-size {b.layout.world_size}` (ZeRO stages 1 to 3; docs/reshard.md)",
        )


@rule("CK502")
def resume_zero_stage(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    """Stages 1 and 2 share one flat layout and file set; stage 3 (and 0) do not."""
    sa, sb = a.layout.zero_stage, b.layout.zero_stage
    if sa != sb and not {sa, sb} <= {1, 2}:
        yield finding(
            "CK502",
            json_path("layout", "zero_stage"),
            f"the ZeRO stage changes from {sa} to {sb}; a stage-{sb} job reads other files and another "
            f"partitioning than stage {sa} saved",
            f"resume with ZeRO stage {sa} (stages 1 and 2 are interchangeable)"
            + (
                f", or rewrite the checkpoint: `ckptspec reshard A OUTPUT --world-size {b.layout.world_size} "
                f"--stage {sb}` (docs/reshard.md)"
                if sa in (1, 2, 3) and sb in (1, 2, 3)
                else ""
            ),
        )


@rule("CK503")
def resume_precision(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    """The optimizer-states file names carry a ``bf16_`` prefix only in bf16 jobs (engine.py); at
    stage 0 a bf16 or fp16 job wraps its optimizer (FP16_Optimizer, BF16_Optimizer) and an fp32 job
    does not, so neither loads the other's optimizer state dict."""
    da, db = a.layout.model_dtype, b.layout.model_dtype
    if _partitioned(a) and _partitioned(b) and (da == "bfloat16") != (db == "bfloat16"):
        yield finding(
            "CK503",
            json_path("layout", "model_dtype"),
            f"the model dtype changes from {da} to {db}; a {'bf16' if db == 'bfloat16' else 'non-bf16'} job "
            f"opens optimizer files named {'bf16_zero_pp_rank_*' if db == 'bfloat16' else 'zero_pp_rank_*'}, "
            "which this checkpoint does not have",
            f"resume in {da}, or load the weights only (load_module_only=True)",
        )
    elif a.layout.zero_stage == b.layout.zero_stage == 0 and (da == "float32") == (db == "float32"):
        oa, ob = a.layout.optimizer, b.layout.optimizer
        if oa is not None and ob is not None and oa != ob:
            yield finding(
                "CK503",
                json_path("layout", "optimizer"),
                f"the optimizer changes from {oa} to {ob} at ZeRO stage 0: a job loads the optimizer state as "
                f"its own wrapper's state dict, and {ob}'s is not {oa}'s",
                f"resume with A's optimizer ({oa}), or load the weights only (load_module_only=True)",
            )
    elif a.layout.zero_stage == b.layout.zero_stage == 0 and (da == "float32") != (db == "float32"):
        yield finding(
            "CK503",
            json_path("layout", "model_dtype"),
            f"the model dtype changes from {da} to {db} at ZeRO stage 0: the {db} job's optimizer "
            f"({'a plain torch optimizer' if db == 'float32' else 'a DeepSpeed mixed-precision wrapper'}) "
            "cannot load the optimizer state the other saved",
            f"resume in {da}, or load the weights only (load_module_only=True)",
        )


@rule("CK504")
def resume_module_keys(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    """load_module_strict=True: the saved module's keys must be exactly B's state-dict keys."""
    saved = {n for n, t in ta.items() if t.saved}
    missing = [n for n in tb if n not in saved]
    unexpected = [n for n in ta if n in saved and n not in tb]
    if missing:
        excluded = [n for n in missing if n in ta and not ta[n].saved]
        why = " (saved with exclude_frozen_parameters)" if excluded else ""
        yield finding(
            "CK504",
            tb[missing[0]].path,
            f"{len(missing)} name(s) of B are not in A's saved module{why}: {_names(missing)}",
            "a strict module load fails on missing keys; add them to the checkpoint's model or resume "
            "with the model that saved it",
        )
    if unexpected:
        yield finding(
            "CK504",
            "$",
            f"{len(unexpected)} name(s) saved in A are not in B: {_names(unexpected)}",
            "a strict module load fails on unexpected keys; resume with the model that saved the checkpoint",
        )


@rule("CK505")
def resume_shape(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    for name, t in tb.items():
        old = ta.get(name)
        if old is not None and old.shape is not None and t.shape is not None and old.shape != t.shape:
            yield finding(
                "CK505",
                t.path + ".shape",
                f"{name!r} has shape {list(old.shape)} in A but {list(t.shape)} in B",
                "resume with the shapes the checkpoint was saved with; a changed model needs a fresh "
                "optimizer (load_module_only cannot load it either)",
            )


@rule("CK506")
def resume_trainable_set(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    for name, t in tb.items():
        old = ta.get(name)
        if old is not None and (old.role == "trainable") != (t.role == "trainable"):
            yield finding(
                "CK506",
                t.path,
                f"{name!r} is {old.role} in A but {t.role} in B; the optimizer holds another set of "
                "tensors, so A's optimizer partitions do not fit B's",
                "resume with the same frozen parameters and ties, or load the weights only "
                "(load_module_only=True) and start a fresh optimizer",
            )


def _group_reason(a: Manifest, b: Manifest) -> Finding | None:
    changes = group_changes(a, b)
    if not changes:
        return None
    first = changes[0]
    what = (
        f"A has {first.a} optimizer partition group(s), B has {first.b}"
        if first.kind == "group-count"
        else f"{first.name} is {first.a} in A but {first.b} in B"
        if first.kind == "group"
        else f"A has {first.a} here, B has {first.b}"
    )
    flags = [c for c in layout_changes(a, b) if c.name in ("round_robin", "parameter_alignment", "sub_group_size")]
    cause = "".join(f"; {c.name} changes from {c.a} to {c.b}" for c in flags)
    return finding(
        "CK507",
        first.path,
        f"the optimizer's flat layout differs ({what}{cause}); DeepSpeed would copy A's partitions "
        "into B's positions without checking them",
        "resume with the same parameter groups, order, round_robin_gradients, parameter_alignment and "
        "sub_group_size as the run that saved the checkpoint",
    )


@rule("CK507")
def resume_group_layout(a: Manifest, b: Manifest, ta, tb) -> Iterator[Finding]:
    """Same names, shapes and trainable set, but another flat layout: the silent case."""
    if (first := _group_reason(a, b)) is not None:
        yield first


ROOT_CAUSES = ("CK501", "CK502", "CK504", "CK505", "CK506")


def resume_reasons(a: Manifest, b: Manifest) -> list[Finding]:
    ta, tb = tensors(a), tensors(b)
    reasons: list[Finding] = []
    for r in RULES:
        # A layout difference that another reason already explains would only repeat it.
        if r.code == "CK507" and any(found.code in ROOT_CAUSES for found in reasons):
            continue
        reasons += r.check(a, b, ta, tb)
    return reasons


def diff_manifests(a: Manifest, b: Manifest) -> Diff:
    """Changes from A to B (layout, tensors, groups) and the reasons B cannot resume from A."""
    changes = layout_changes(a, b) + tensor_changes(tensors(a), tensors(b)) + group_changes(a, b)
    return Diff(changes, resume_reasons(a, b))


__all__ = ["Diff", "Change", "diff_manifests", "resume_reasons", "RULES", "DIFF_VERSION"]

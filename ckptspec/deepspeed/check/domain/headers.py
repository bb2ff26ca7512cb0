"""CK211-CK212: every optimizer and model states file's own header agrees with the manifest."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from operator import attrgetter, eq, methodcaller

from ....findings import Finding, RuleSet, finding, json_path
from ...describe.zero import real_ties
from ...layout.legacy import saved_stage
from ...layout.names import PIPE_LAYER_RE, mp_rank_of
from .context import Check, Context

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register
_NAME, _SHAPE = attrgetter("name"), attrgetter("shape")
_ITEMS, _VALUES = methodcaller("items"), methodcaller("values")


def _versions(state: dict, osd: dict | None = None) -> list[str]:
    out = [state.get("ds_version")]
    if osd is not None:
        out.append(osd.get("ds_version"))
    return [str(v) for v in out if v is not None]


@check("CK211")
def optimizer_header(ctx: Context) -> Iterator[Finding]:
    """Every optimizer file agrees with the manifest (not only file 0): stage, partition count, group count, version."""
    layout, groups = ctx.layout, ctx.manifest.groups
    hint = "the optimizer files come from different runs or settings; restore the files of one save"
    bf16_opt = layout.optimizer == "BF16_Optimizer" or (layout.optimizer is None and layout.tail_padding_saved)
    for f in ctx.readable("optimizer_states"):
        state = f.state
        osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(osd, dict):
            yield finding(
                "CK211",
                f.at(),
                "no 'optimizer_state_dict' in the file: not a DeepSpeed optimizer states file",
                hint,
                file=f.name,
                rank=f.rank,
            )
            continue
        if "zero_stage" in osd:
            try:
                stage = int(osd["zero_stage"])
            except (TypeError, ValueError):
                stage = None
            if stage is not None:  # DeepSpeed 0.5.9-0.6.7 write 2 for a stage-1 run
                stage = saved_stage(stage, layout.zero_stage, osd.get("ds_version"))
            if stage != layout.zero_stage:
                yield finding(
                    "CK211",
                    json_path("layout", "zero_stage"),
                    f"file says ZeRO stage {repr(osd['zero_stage']) if stage is None else stage}, "
                    f"the checkpoint is stage {layout.zero_stage}",
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
        elif not bf16_opt:
            yield finding(
                "CK211", json_path("layout", "zero_stage"), "file records no ZeRO stage", hint, file=f.name, rank=f.rank
            )
        counts = osd.get("partition_count")
        if layout.zero_stage == 3:
            if counts != layout.world_size or isinstance(counts, bool):
                said = (  # stages 1 and 2 record a list, one count per group: not a count of ranks
                    f"partition counts {counts!r}, one per group as ZeRO stages 1 and 2 record them; a stage-3 "
                    f"file records one number, the world size {layout.world_size}"
                    if isinstance(counts, list)
                    else f"partition count {counts!r}, the checkpoint has {layout.world_size} ranks"
                )
                yield finding(
                    "CK211",
                    json_path("layout", "world_size"),
                    f"file says {said}",
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
        else:
            expected = [g.partition_count for g in groups]
            if not isinstance(counts, list) or counts != expected:
                said = (
                    f"one partition count, {counts!r}, as ZeRO stage 3 records it (one number); the manifest has "
                    f"one per group, {expected}"
                    if isinstance(counts, int) and not isinstance(counts, bool)
                    else f"partition counts {counts!r}, the manifest has {expected}"
                )
                yield finding(
                    "CK211",
                    json_path("groups"),
                    f"file says {said}",
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
        flat = osd.get(ctx.flat_key)
        n = len(flat) if isinstance(flat, list) else None
        if n != len(groups):
            yield finding(
                "CK211",
                json_path("groups"),
                f"file holds {n if n is not None else 'no'} flat groups ({ctx.flat_key}), the manifest has "
                f"{len(groups)}",
                hint,
                file=f.name,
                rank=f.rank,
            )
        expected_version = ctx.expected_version
        for version in set(_versions(state, osd)):
            if expected_version is not None and version != expected_version:
                yield finding(
                    "CK211",
                    json_path("producer", "framework_version"),
                    f"file was written by DeepSpeed {version}, the checkpoint by {expected_version}",
                    hint,
                    file=f.name,
                    rank=f.rank,
                )


def _param_shapes(ctx: Context) -> list[list[tuple[str, list[int]]]]:
    return [[(p.name, list(p.shape)) for p in g.params] for g in ctx.manifest.groups]


def _saved_as_recorded(param_shapes: list, recorded: list[list[tuple[str, tuple]]]) -> bool:
    """``param_shapes`` holds exactly ``recorded``: names that are strings, shapes that are tuples of
    ints. Compared in C (a million params in a 1M-tensor model); anything else is compared the slow way."""
    if len(param_shapes) != len(recorded) or not all(isinstance(group, dict) for group in param_shapes):
        return False  # (DeepSpeed saves each group as an OrderedDict: its own items, in its order)
    shapes = list(chain.from_iterable(map(_VALUES, param_shapes)))
    return (
        set(map(type, chain.from_iterable(param_shapes))) <= {str}
        and set(map(type, shapes)) <= {tuple}
        and set(map(type, chain.from_iterable(shapes))) <= {int}
        and all(map(eq, map(list, map(_ITEMS, param_shapes)), recorded))
    )


def _as_shape(value) -> list[int] | None:
    try:
        return [int(d) for d in value]
    except (TypeError, ValueError):
        return None


@check("CK212")
def model_header(ctx: Context) -> Iterator[Finding]:
    """Every model states file agrees with the manifest: param_shapes (names, order, shapes),
    frozen shapes, ties, buffers, world size, version."""
    hint = (
        "the model states disagree with the manifest; restore the files of one save "
        "(or regenerate the manifest if it is stale)"
    )
    recorded_shapes = [list(zip(map(_NAME, g.params), map(tuple, map(_SHAPE, g.params)))) for g in ctx.manifest.groups]
    fragment_frozen = {f.name: list(f.shape) for f in ctx.manifest.frozen if f.stored_in != "module"}
    aliases = {a.name: a.owner for a in ctx.manifest.aliases}
    buffers = {b.name for b in ctx.manifest.buffers}
    for f in ctx.readable("model_states"):
        state = f.state
        # A pipeline stage's module is None: its weights are in the layer files (checked by the index, CK230);
        # a PipelineModule at one stage writes layer files too.
        pipeline_stage = (
            isinstance(state, dict)
            and state.get("module") is None
            and (
                ctx.layout.pipeline_parallel_size > 1 or any(PIPE_LAYER_RE.match(p.name) for p in ctx.tag_dir.iterdir())
            )
        )
        if (
            not isinstance(state, dict)
            or not (isinstance(state.get("module"), dict) or pipeline_stage)
            or not isinstance(state.get("param_shapes"), list)
        ):
            yield finding(
                "CK212",
                f.at(),
                "not a DeepSpeed model states file (no 'module' dict or no 'param_shapes' list)",
                hint,
                file=f.name,
                rank=f.rank,
            )
            continue
        actual: list
        expected_shapes: list
        if _saved_as_recorded(state["param_shapes"], recorded_shapes):
            actual, expected_shapes = [], []  # the same: what the slow way below would find
        else:
            expected_shapes, actual = _param_shapes(ctx), []
            for group in state["param_shapes"]:
                items = group.items() if isinstance(group, dict) else []
                actual.append([(str(n), _as_shape(s)) for n, s in items])
        if actual != expected_shapes:
            yield finding(
                "CK212",
                json_path("groups"),
                "param_shapes " + _first_difference(actual, expected_shapes),
                hint,
                file=f.name,
                rank=f.rank,
            )
        ws = state.get("dp_world_size")
        if ws is not None and ws != ctx.world_size:
            yield finding(
                "CK212",
                json_path("layout", "world_size"),
                f"file says data-parallel world size {ws!r}, the manifest {ctx.world_size}",
                hint,
                file=f.name,
                rank=f.rank,
            )
        expected_version = ctx.expected_version
        version = state.get("ds_version")
        if expected_version is not None and version is not None and str(version) != expected_version:
            yield finding(
                "CK212",
                json_path("producer", "framework_version"),
                f"file was written by DeepSpeed {version}, the checkpoint by {expected_version}",
                hint,
                file=f.name,
                rank=f.rank,
            )
        frozen_shapes = state.get("frozen_param_shapes")
        if fragment_frozen or frozen_shapes:
            recorded = (
                {str(n): _as_shape(s) for n, s in frozen_shapes.items()} if isinstance(frozen_shapes, dict) else {}
            )
            recorded = {n: s for n, s in recorded.items() if n not in aliases}
            if recorded != fragment_frozen:
                yield finding(
                    "CK212",
                    json_path("frozen"),
                    "frozen_param_shapes " + _dict_difference(recorded, fragment_frozen),
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
        shared = state.get("shared_params")
        if isinstance(shared, dict) and ((f.rank in (0, None) and not mp_rank_of(f.name)) or shared):
            # DeepSpeed computes the ties on global rank 0 only; the other ranks' files hold {} (a data-parallel
            # rank's, and under AutoTP every other tensor rank's mp_rank_XX file: describe/model_parallel.py).
            real = real_ties({str(k): str(v) for k, v in shared.items()}, state["module"], ctx.layout.zero_stage)
            if real != aliases:
                yield finding(
                    "CK212",
                    json_path("aliases"),
                    "shared_params " + _dict_difference(real, aliases),
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
        names = state.get("buffer_names")
        # A pipeline stage's buffers are in its layer files (the index's, CK230), not in its manifest.
        if isinstance(names, list) and not pipeline_stage and set(map(str, names)) != buffers:
            yield finding(
                "CK212",
                json_path("buffers"),
                "buffer_names " + _dict_difference(dict.fromkeys(map(str, names)), dict.fromkeys(buffers)),
                hint,
                file=f.name,
                rank=f.rank,
            )


def _first_difference(actual: list[list], expected: list[list]) -> str:
    if len(actual) != len(expected):
        return f"has {len(actual)} groups, the manifest {len(expected)}"
    for g, (a, e) in enumerate(zip(actual, expected)):
        if a == e:
            continue
        if [n for n, _ in a] == [n for n, _ in e]:
            k = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
            return f"group {g}: {a[k][0]} has shape {a[k][1]}, the manifest {e[k][1]}"
        if sorted(n for n, _ in a) == sorted(n for n, _ in e):
            k = next(i for i, (x, y) in enumerate(zip(a, e)) if x[0] != y[0])
            return f"group {g}: order differs at position {k}: {a[k][0]} where the manifest has {e[k][0]}"
        extra = sorted({n for n, _ in a} - {n for n, _ in e})
        missing = sorted({n for n, _ in e} - {n for n, _ in a})
        return f"group {g}: names differ (file only: {extra}, manifest only: {missing})"
    return "differs"


def _dict_difference(actual: dict, expected: dict) -> str:
    extra = sorted(set(actual) - set(expected))
    missing = sorted(set(expected) - set(actual))
    changed = sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k])
    parts = []
    if extra:
        parts.append(f"file only: {extra}")
    if missing:
        parts.append(f"manifest only: {missing}")
    if changed:
        parts.append("differ: " + ", ".join(f"{k} ({actual[k]!r} vs {expected[k]!r})" for k in changed))
    return "disagree with the manifest (" + "; ".join(parts) + ")"

"""CK221-CK223 (format 1.1): the files hold what 1.1's locators, digests and save counters say.

* CK221: every named tensor, flat low-precision group and optimizer state partition the
  manifest locates is where the file's own pickle and zip directory put it (as CK214 for the
  master partitions), and an optimizer file's per-element states are all located.
* CK222: every recorded tensor digest matches the tensor's real elements (read only with hashes).
* CK223: every file belongs to the save the manifest describes: the model states' training
  counters and embedded save id, the optimizer states' step of every param group. A file of
  another save of the same layout passes every other check; these values tell it apart
  without hashing a byte of tensor data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ....checkpoint.torchfile import TensorRef
from ....findings import Finding, RuleSet, finding, json_path
from ....location import RemotePath
from ...describe.digests import digests_of
from ...describe.locators import fragment_numel, torch_optimizer_state
from ...describe.scalars import counters, embedded_copy, index_steps
from .context import Check, Context, File

CHECKS: RuleSet[Check] = RuleSet()
check = CHECKS.register

_FIELDS = ("member", "data_offset", "member_size", "dtype", "element_offset", "numel")


def _compare(real: tuple, loc) -> str:
    recorded_ = tuple(getattr(loc, n) for n in _FIELDS)
    return ", ".join(f"{n} {r!r} (manifest {m!r})" for n, r, m in zip(_FIELDS, real, recorded_) if r != m)


def _real(ref: TensorRef, members: dict, numel: int) -> tuple:
    return (ref.storage.member, *members.get(ref.storage.member, (None, None)), ref.dtype, ref.storage_offset, numel)


def _named_holders(ctx: Context) -> dict[str, tuple[str, int | None]]:
    """Located name -> (the table of the model states holding it, its numel or None for a stage-3 fragment)."""
    out: dict[str, tuple[str, int | None]] = {}
    for f in ctx.manifest.frozen:
        if f.stored_in == "partitioned_fragments":
            out[f.name] = ("frozen_param_fragments", None)
        else:
            out[f.name] = ("module" if f.stored_in == "module" else "frozen_param_fragments", f.numel)
    for b in ctx.manifest.buffers:
        numel = 1
        for d in b.shape:
            numel *= d
        out[b.name] = ("module", numel)
    return out


@check("CK221")
def tensor_locator(ctx: Context) -> Iterator[Finding]:
    holders = _named_holders(ctx)
    for f, state in ctx.model_files():
        if f.index in ctx.before_embed:
            continue  # CK227: the manifest predates an embed that moved every record of the file
        assert f.loaded is not None  # a model-states file read (it has a state)
        members = f.loaded.members or {}
        for k, loc in enumerate(f.entry.tensors or ()):
            if loc.name not in holders:
                continue  # CK120
            table_name, numel = holders[loc.name]
            table = state.get(table_name)
            ref = table.get(loc.name) if isinstance(table, dict) else None
            if numel is None and isinstance(ref, TensorRef) and f.rank is not None:
                whole = next(fr.numel for fr in ctx.manifest.frozen if fr.name == loc.name)
                numel = fragment_numel(whole, ctx.world_size, f.rank)
            yield from _check_tensor(f, f.at("tensors", k), loc, ref, numel, f"{table_name}[{loc.name!r}]")
        module: Any = state.get("module") if isinstance(state.get("module"), dict) else {}
        for k, weights in enumerate(f.entry.model_weights or ()):
            if weights.group >= len(ctx.manifest.groups):
                continue
            refs = [module.get(p.name) for p in ctx.manifest.groups[weights.group].params if p.numel]
            storages = {r.storage for r in refs if isinstance(r, TensorRef)}
            if len(storages) != 1 or len(refs) != sum(isinstance(r, TensorRef) for r in refs):
                yield _finding(
                    f, f.at("model_weights", k), f"group {weights.group}'s module tensors share no flat storage"
                )
                continue
            storage = storages.pop()
            real = (storage.member, *members.get(storage.member, (None, None)), storage.dtype, 0, storage.numel)
            if diff := _compare(real, weights):
                yield _finding(f, f.at("model_weights", k), f"group {weights.group}'s flat weights: {diff}")
    for f, _ in ctx.optim_files():
        yield from _state_partitions(ctx, f)


def _check_tensor(f: File, where: str, loc, ref, numel: int | None, what: str) -> Iterator[Finding]:
    if not isinstance(ref, TensorRef):
        yield _finding(f, where, f"{what} is not a tensor of the file")
    elif not ref.is_contiguous() or numel is None or numel > ref.numel:
        yield _finding(f, where, f"{what} is not {numel} contiguous elements in the file")
    else:
        assert f.loaded is not None  # a file that was read
        if diff := _compare(_real(ref, f.loaded.members or {}, numel), loc):
            yield _finding(f, where, f"{what}: {diff}")


def _state_partitions(ctx: Context, f: File) -> Iterator[Finding]:
    if f.entry.state_partitions is None or f.rank is None:
        return
    by_index = torch_optimizer_state(f.state).get("state")
    by_index = by_index if isinstance(by_index, dict) else {}
    located = set()
    for k, loc in enumerate(f.entry.state_partitions):
        located.add((loc.group, loc.state))
        entry = by_index.get(loc.group)
        ref = entry.get(loc.state) if isinstance(entry, dict) else None
        what = f"state {loc.state!r} of group {loc.group}"
        if loc.rank != f.rank:
            yield _finding(f, f.at("state_partitions", k), f"{what}: rank {loc.rank} in rank {f.rank}'s file")
        else:
            yield from _check_tensor(f, f.at("state_partitions", k), loc, ref, loc.numel, what)
    for g, entry in sorted((g, e) for g, e in by_index.items() if isinstance(g, int) and isinstance(e, dict)):
        for key, ref in entry.items():
            if isinstance(ref, TensorRef) and ref.shape and (g, key) not in located and g < len(ctx.manifest.groups):
                yield _finding(
                    f, f.at("state_partitions"), f"state {key!r} of group {g} is in the file but not located"
                )


def _finding(f: File, where: str, message: str) -> Finding:
    return finding(
        "CK221",
        where,
        message,
        "a reader following the locator would read the wrong bytes; regenerate the manifest or restore the file",
        file=f.name,
        rank=f.rank,
    )


@check("CK222")
def tensor_digest(ctx: Context) -> Iterator[Finding]:
    checked = ctx.digested()
    if isinstance(ctx.tag_dir, RemotePath):  # with the file hashes, from one read of the bytes
        actual = ctx.read_once()[1]
    else:
        actual = digests_of([covered for covered, _ in checked], ctx.tag_dir)
    for (covered, want), sha256 in zip(checked, actual):
        if sha256 != want:
            files = {path for path, _, _ in covered.ranges}
            one = next(iter(files)) if len(files) == 1 else None
            file = next((f for f in ctx.files if f.name == one), None)
            yield finding(
                "CK222",
                json_path(*covered.where),
                f"sha256 of the tensor's elements is {sha256[:16]}..., the manifest records {want[:16]}..."
                + ("" if one else f" (its bytes are in {', '.join(sorted(files))})"),
                "the tensor's bytes changed after the manifest was written (bit rot, a partial copy, another "
                "save); restore the file",
                file=one,
                rank=file.rank if file is not None else None,
            )


@check("CK223")
def other_save(ctx: Context) -> Iterator[Finding]:
    save, optimizer = ctx.manifest.save, ctx.manifest.optimizer
    hint = "the file belongs to another save (another step or run); restore the files of one save"
    if save is not None:
        for f, state in ctx.model_files():
            found = counters(state) or {}
            for key, value in found.items():
                if value != getattr(save, key):
                    yield finding(
                        "CK223",
                        json_path("save", key),
                        f"the file records {key} {value}, the manifest {getattr(save, key)}",
                        hint,
                        file=f.name,
                        rank=f.rank,
                    )
            embedded = (embedded_copy(state) or {}).get("save")
            other = embedded.get("id") if isinstance(embedded, dict) else None
            if save.id is not None and isinstance(other, str) and other != save.id:
                yield finding(
                    "CK223",
                    json_path("save", "id"),
                    f"the file was saved with save id {other}, the manifest's is {save.id}",
                    hint,
                    file=f.name,
                    rank=f.rank,
                )
    if optimizer is not None:
        steps = {g.optimizer_group: g.step for g in optimizer.groups}
        for f, _ in ctx.optim_files():
            assert f.loaded is not None and f.path is not None  # read: it has a state
            for g, value in index_steps(ctx.manifest, f.state, f.path, f.loaded.members or {}).items():
                group = ctx.manifest.groups[g].optimizer_group
                if group in steps and value != steps[group]:
                    k = next(i for i, g in enumerate(optimizer.groups) if g.optimizer_group == group)
                    yield finding(
                        "CK223",
                        json_path("optimizer", "groups", k, "step"),
                        f"the file's optimizer group {group} is at step {value}, the manifest's at {steps[group]}",
                        hint,
                        file=f.name,
                        rank=f.rank,
                    )

"""Which module parameter each fp32 master of a ZeRO stage-0 checkpoint is (issue #40): DeepSpeed records no names
at stage 0 (``param_shapes`` and ``shared_params`` are None), its optimizer's ``fp32_groups`` hold the masters of the
trainable parameters in module order, and its module every parameter.

* a tie (one parameter under two names) is the same pickled tensor twice in ``module``: the later name an alias of
  the first (``stage0_ties``), which the optimizer holds once;
* a frozen parameter holds no master: where the masters are fewer than the parameters, they are named by the one
  order-keeping choice of parameters with their shapes (``frozen_apart``); none, or several, is CK202, never a guess.
  Without mixed precision (fp32) the module's weights are the masters, and what tells the trainable ones is the client
  torch optimizer's ``state_dict()`` (the model states' ``optimizer``): its ``param_groups`` list the parameters it
  steps, and each one's per-element state (``exp_avg``...) has its shape (``client_moments``).

Metadata only: shapes and storages of the decoded pickles, no tensor bytes.
"""

from __future__ import annotations

from typing import Any

from ...checkpoint.torchfile import TensorRef
from ...errors import UnsupportedCheckpoint
from .ties import repeated

UNNAMED_HINT = "the masters of this checkpoint cannot be named from its files; it is not described"


def stage0_ties(model: dict) -> dict[str, str]:
    """alias -> owner: a module entry that is an earlier entry's very tensor (the same storage, offset, shape and
    strides), one parameter under two names. DeepSpeed records no ``shared_params`` at stage 0 (None), and its
    optimizer holds a tied parameter once (``module.parameters()`` yields it once, under the first name)."""
    buffers = set(model.get("buffer_names") or [])
    entries = [
        (name, ref.view)
        for name, ref in (model.get("module") or {}).items()
        if name not in buffers and isinstance(ref, TensorRef) and ref.numel
    ]
    first: dict[tuple, str] = {}
    out = {}
    for name, view in repeated(entries, (view for _, view in entries)):  # the few tied among many
        owner = first.setdefault(view, name)
        if owner != name:
            out[name] = owner
    return out


def client_moments(optimizer: Any, params: int, model_file: str) -> list[TensorRef] | None:
    """fp32 at stage 0: a per-element state tensor (``exp_avg``...) of each parameter the client torch optimizer's
    ``state_dict()`` (``optimizer``) lists in its ``param_groups``, in their order: each has its parameter's shape, what
    ``frozen_apart`` names the trainable ones among the module's ``params`` parameters by. None where it lists as many
    (nothing frozen) or is no torch state dict. CK202 where a listed parameter has no such state (an optimizer without
    per-element state, a parameter never stepped): the frozen parameters are not told apart, never guessed."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    listed = [i for g in groups for i in (g.get("params") or [])]
    if len(listed) >= params:
        return None
    state = optimizer.get("state") if isinstance(optimizer.get("state"), dict) else {}
    held = []
    for i in listed:
        entry = state.get(i)
        tensors = [r for k, r in entry.items() if k != "step" and isinstance(r, TensorRef)] if entry else []
        if not tensors or len({tuple(r.shape) for r in tensors}) != 1:
            raise UnsupportedCheckpoint(
                f"ZeRO stage 0, fp32: the optimizer steps {len(listed)} of the module's {params} parameters and its "
                f"state of parameter {i} holds {'no' if not tensors else 'more than one'} shape of per-element state "
                "(the frozen parameters are told apart at fp32 by the shapes of the optimizer's state)",
                UNNAMED_HINT,
                model_file,
            )
        held.append(tensors[0])
    return held


def frozen_apart(
    model: dict, dense: list[tuple[str, tuple[int, ...]]], held: list, model_file: str
) -> list[tuple[str, tuple[int, ...]]] | None:
    """The trainable parameters among ``dense`` (the module's parameters, in order) when ``held`` (the
    ``fp32_groups`` masters, in order) are fewer: the one order-keeping choice of parameters whose shapes are the
    masters' shapes, the others frozen (a frozen parameter is in the module, not in the optimizer). None when as many
    masters as parameters are held (ties, ``stage0_ties``, taken out of ``dense`` first). Refused by name (CK202), never
    guessed: two module entries sharing a storage otherwise, or more than one such choice (shapes that repeat around
    a frozen one)."""
    if len(held) >= len(dense) or not all(isinstance(ref, TensorRef) for ref in held):
        return None
    module = model["module"]
    storages: dict[object, str] = {}
    for name, _ in dense:
        other = storages.setdefault(module[name].storage.key, name)
        if other != name:
            raise UnsupportedCheckpoint(
                f"ZeRO stage 0: {name!r} shares its storage with {other!r} and optimizer/fp32_groups holds "
                f"{len(held)} masters for {len(dense)} parameters (views of one storage that are not one tensor are "
                "not told apart at stage 0)",
                UNNAMED_HINT,
                model_file,
            )
    shapes = [tuple(ref.shape) for ref in held]
    count, choice = _embeddings(shapes, [shape for _, shape in dense])
    if count != 1:
        raise UnsupportedCheckpoint(
            f"ZeRO stage 0: optimizer/fp32_groups holds {len(held)} masters for {len(dense)} parameters, and "
            f"{'no' if not count else 'more than one'} choice of parameters in module order has their shapes "
            "(frozen parameters are told apart at stage 0 only when one choice has)",
            UNNAMED_HINT,
            model_file,
        )
    return [dense[i] for i in choice]


def _greedy(wanted: list[tuple], shapes: list[tuple]) -> tuple[int, ...] | None:
    """The earliest increasing index tuple ``ix`` with ``shapes[ix[k]] == wanted[k]`` for every k; None: none."""
    found, i = [], 0
    for shape in wanted:
        while i < len(shapes) and shapes[i] != shape:
            i += 1
        if i == len(shapes):
            return None
        found.append(i)
        i += 1
    return tuple(found)


def _embeddings(wanted: list[tuple], shapes: list[tuple]) -> tuple[int, tuple[int, ...]]:
    """How many ways there are to keep ``wanted`` in ``shapes`` in order (0, 1, or 2 for more than one), and the
    earliest. Every way lies, index by index, between the earliest and the latest (the earliest read backwards), so
    there is one exactly when those two are the same: linear in the model's length."""
    first = _greedy(wanted, shapes)
    if first is None:
        return 0, ()
    last = _greedy(wanted[::-1], shapes[::-1])
    assert last is not None  # the earliest exists, so the latest does
    return (1 if first == tuple(len(shapes) - 1 - i for i in reversed(last)) else 2), first


def named_by_shapes(held: list[tuple[int, ...]], dense: list[tuple[str, tuple[int, ...]]]) -> list[str] | None:
    """The parameters ``frozen_apart`` names for masters of the shapes ``held`` (in ``fp32_groups`` order) among
    ``dense`` (the module's parameters, in order, with their shapes): the one order-keeping choice; None when there
    is none or more than one (what a stage-0 file's reader refuses, CK202)."""
    count, choice = _embeddings(held, [shape for _, shape in dense])
    return [dense[i][0] for i in choice] if count == 1 else None

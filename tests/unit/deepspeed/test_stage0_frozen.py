"""The rule of ``deepspeed/layout/stage0_names.frozen_apart`` (issue #40), on hand-made decoded model states: a stage-0
job's ``fp32_groups`` hold a master per parameter its optimizer steps, in module order, and none for a frozen one; the
masters are named by the one order-keeping choice of module parameters with their shapes, or the checkpoint is refused
by name (CK202), never guessed. The real checkpoint (AutoTP tp2, a frozen split weight and a frozen whole bias) is in
tests/export/test_reshard_autotp_stage0_world.py."""

from __future__ import annotations

import pytest

from ckptspec.checkpoint.torchfile import StorageRef, TensorRef
from ckptspec.deepspeed.layout.stage0_names import frozen_apart
from ckptspec.errors import UnsupportedCheckpoint


def _ref(key: str, shape: tuple) -> TensorRef:
    numel = 1
    for n in shape:
        numel *= n
    storage = StorageRef(member=f"f/data/{key}", key=key, dtype="bfloat16", itemsize=2, numel=numel, location="cpu")
    return TensorRef(storage=storage, storage_offset=0, shape=shape, stride=(shape[-1], 1)[-len(shape) :])


def _module(shapes: dict[str, tuple]) -> tuple[dict, list]:
    module = {name: _ref(str(i), shape) for i, (name, shape) in enumerate(shapes.items())}
    return {"module": module}, [(name, shape) for name, shape in shapes.items()]


def _masters(*shapes: tuple) -> list:
    return [_ref(f"m{i}", shape) for i, shape in enumerate(shapes)]


def test_the_masters_shapes_in_module_order_name_the_trained_parameters():
    """AutoTP's MLP with its first weight and the head's bias frozen: one choice only."""
    model, dense = _module({"up.w": (16, 16), "up.b": (16,), "down.w": (16, 16), "down.b": (16,), "head.b": (5,)})
    trained = frozen_apart(model, dense, _masters((16,), (16, 16), (16,)), "mp_rank_00_model_states.pt")
    assert trained == [("up.b", (16,)), ("down.w", (16, 16)), ("down.b", (16,))]


def test_as_many_masters_as_parameters_leave_nothing_frozen():
    model, dense = _module({"a": (2,), "b": (3,)})
    assert frozen_apart(model, dense, _masters((2,), (3,)), "f") is None


def test_more_than_one_choice_is_refused():
    """Two parameters of one shape, one of them frozen: which one is not in the files."""
    model, dense = _module({"a": (4,), "b": (4,), "c": (2,)})
    with pytest.raises(UnsupportedCheckpoint) as info:
        frozen_apart(model, dense, _masters((4,), (2,)), "mp_rank_01_model_states.pt")
    assert info.value.code == "CK202" and "more than one choice" in str(info.value)
    assert "mp_rank_01_model_states.pt" in str(info.value)


def test_no_choice_is_refused():
    model, dense = _module({"a": (4,), "b": (3,)})
    with pytest.raises(UnsupportedCheckpoint, match="no choice of parameters"):
        frozen_apart(model, dense, _masters((2,)), "f")


def test_a_tie_is_refused():
    """A tied weight is in the module under two names, one storage, and has one master: not a frozen parameter."""
    model, dense = _module({"emb": (8, 4), "mid": (4,), "out": (8, 4)})
    model["module"]["out"] = model["module"]["emb"]
    with pytest.raises(UnsupportedCheckpoint, match="'out' shares its storage with 'emb'") as info:
        frozen_apart(model, dense, _masters((8, 4), (4,)), "f")
    assert info.value.code == "CK202"


def test_a_model_of_thousands_of_parameters_is_no_deeper_than_a_small_one():
    """5000 parameters, one frozen in the middle (shapes repeating every 7, so the frozen one is told apart by order
    alone): one choice, found without recursion (the first version walked it one call per master: RecursionError)."""
    shapes = {f"p{i}": (i % 7 + 1, 3) for i in range(5000)}
    model, dense = _module(shapes)
    held = _masters(*[shape for name, shape in shapes.items() if name != "p2500"])
    trained = frozen_apart(model, dense, held, "f")
    assert trained is not None and len(trained) == 4999 and ("p2500", (2500 % 7 + 1, 3)) not in trained


def test_the_count_of_choices_is_the_count_of_every_choice_tried():
    """Small models of three shapes, every increasing choice of parameters tried: the rule finds a choice exactly
    when one exists, takes the earliest, and tells one from several."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(500):
        shapes = [(rng.randint(1, 3),) for _ in range(rng.randint(1, 8))]
        masters = [(rng.randint(1, 3),) for _ in range(rng.randint(1, len(shapes)))]
        choices = itertools.combinations(range(len(shapes)), len(masters))
        ways = [c for c in choices if [shapes[i] for i in c] == masters]
        model, dense = _module({f"p{i}": shape for i, shape in enumerate(shapes)})
        held = _masters(*masters)
        if len(masters) == len(shapes):
            assert frozen_apart(model, dense, held, "f") is None
        elif len(ways) == 1:
            assert frozen_apart(model, dense, held, "f") == [dense[i] for i in ways[0]]
        else:
            with pytest.raises(UnsupportedCheckpoint, match="no choice" if not ways else "more than one choice"):
                frozen_apart(model, dense, held, "f")

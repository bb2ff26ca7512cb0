"""The rule of ``deepspeed/layout/stage0_names.frozen_apart`` (issue #40), on hand-made decoded model states: a stage-0
job's ``fp32_groups`` hold a master per parameter its optimizer steps, in module order, and none for a frozen one; the
masters are named by the one order-keeping choice of module parameters with their shapes, or the checkpoint is refused
by name (CK202), never guessed. At fp32 (no masters apart from the module) the shapes are those of the client torch
optimizer's per-element state of each parameter its ``param_groups`` list (``client_moments``). The real checkpoints
(AutoTP tp2 bf16, a frozen split weight and a frozen whole bias; dense fp32) are in
tests/export/test_reshard_autotp_stage0_world.py and test_reshard_from_stage0.py."""

from __future__ import annotations

import pytest

from ckptspec.checkpoint.torchfile import StorageRef, TensorRef
from ckptspec.deepspeed.layout.stage0_names import client_moments, frozen_apart
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


def _scalar(key: str) -> TensorRef:
    storage = StorageRef(member=f"f/data/{key}", key=key, dtype="float32", itemsize=4, numel=1, location="cpu")
    return TensorRef(storage=storage, storage_offset=0, shape=(), stride=())


def _adam(shapes: dict[int, tuple], groups: list[list[int]]) -> dict:
    """A torch Adam ``state_dict()``: per listed parameter a 0-d step and two moments of its shape."""
    state = {
        i: {"step": _scalar(f"s{i}"), "exp_avg": _ref(f"a{i}", s), "exp_avg_sq": _ref(f"q{i}", s)}
        for i, s in shapes.items()
    }
    return {"state": state, "param_groups": [{"lr": 0.01, "params": params} for params in groups]}


def test_fp32_the_optimizers_moments_name_the_trained_parameters():
    """The dense MLP's shapes, its first up weight and the head's bias frozen: the client Adam steps the other 8, over
    two param groups, and the shapes of their moments are the masters' shapes frozen_apart names them by."""
    shapes = {"b0.up.w": (32, 16), "b0.up.b": (32,), "b0.down.w": (16, 32), "b0.down.b": (16,)}
    shapes |= {n.replace("b0", "b1"): s for n, s in shapes.items()} | {"head.w": (5, 16), "head.b": (5,)}
    model, dense = _module(shapes)
    trained = [n for n in shapes if n not in ("b0.up.w", "head.b")]
    optimizer = _adam({i: shapes[n] for i, n in enumerate(trained)}, [[0, 1, 2], [3, 4, 5, 6, 7]])
    held = client_moments(optimizer, len(dense), "f")
    assert held is not None and [tuple(r.shape) for r in held] == [shapes[n] for n in trained]
    assert [n for n, _ in frozen_apart(model, dense, held, "f")] == trained


def test_fp32_as_many_parameters_listed_or_no_torch_state_leave_nothing_frozen():
    assert client_moments(_adam({0: (2,), 1: (3,)}, [[0, 1]]), 2, "f") is None
    assert client_moments(None, 2, "f") is None and client_moments({"fp32_groups": []}, 2, "f") is None


def test_fp32_a_listed_parameter_without_per_element_state_is_refused():
    """A parameter never stepped (no state entry), or an optimizer keeping none per element (only ``step``): the
    shapes are not in the file, so neither are the frozen parameters (CK202, the file named)."""
    never_stepped = _adam({0: (4,)}, [[0, 1]])
    with pytest.raises(UnsupportedCheckpoint, match="state of parameter 1 holds no shape") as info:
        client_moments(never_stepped, 3, "mp_rank_00_model_states.pt")
    assert info.value.code == "CK202" and "mp_rank_00_model_states.pt" in str(info.value)
    stepless = {"state": {0: {"step": _scalar("s")}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(UnsupportedCheckpoint, match="holds no shape"):
        client_moments(stepless, 2, "f")

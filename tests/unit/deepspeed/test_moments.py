"""The rules of ``deepspeed/layout/moments.py`` (issue #39), one each, on hand-made decoded files: a
master's moments are at its element positions in the torch state of the tensor holding it, and what
cannot be paired that way is refused by name (CK202), never guessed. The real checkpoints are in
tests/export/test_masters_optimizer_state.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptspec.checkpoint.torchfile import StorageRef, TensorRef
from ckptspec.deepspeed.layout.moments import MomentFinder
from ckptspec.errors import UnsupportedCheckpoint

OPTIM = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _ref(key: str, numel: int, offset: int = 0, shape: tuple | None = None) -> TensorRef:
    storage = StorageRef(member=f"f/data/{key}", key=key, dtype="float32", itemsize=4, numel=numel, location="cpu")
    shape = shape if shape is not None else (numel - offset,)
    return TensorRef(storage=storage, storage_offset=offset, shape=shape, stride=(1,) if shape else ())


class _States:
    """A StateCache of decoded files: name -> object, each member's data at 1000 * its key."""

    def __init__(self, files: dict):
        self.files = files

    def state(self, path: Path):
        return self.files[Path(path).name]

    def members(self, path: Path) -> dict:
        return {f"f/data/{k}": (1000 * int(k), 4096) for k in range(10)}


def _zero_file(state_numel: int) -> dict:
    """A ZeRO 1/2 optimizer file: group 0's flat partition (7 elements) and its torch state."""
    inner = {"state": {0: {"step": _ref("1", 1, shape=()), "exp_avg": _ref("2", state_numel)}}, "param_groups": []}
    inner["param_groups"].append({"lr": 0.1, "params": [0]})
    return {"optimizer_state_dict": {"single_partition_of_fp32_groups": [_ref("3", 7)], "base_optimizer_state": inner}}


KEY = ["optimizer_state_dict", "single_partition_of_fp32_groups", 0]


def test_a_masters_moments_are_at_its_positions_in_the_state_of_its_tensor(tmp_path):
    finder = MomentFinder(tmp_path, _States({OPTIM: _zero_file(8)}))  # the state keeps the padding
    found = finder.locate("w", OPTIM, KEY, 3, 4)
    assert found.file == OPTIM and found.group == 0
    assert found.ranges == {"exp_avg": (2000 + 3 * 4, 16, "float32")}  # "step" (0-d) is no per-element state


def test_a_state_shorter_than_the_masters_tensor_is_refused(tmp_path):
    finder = MomentFinder(tmp_path, _States({OPTIM: _zero_file(6)}))
    with pytest.raises(UnsupportedCheckpoint) as info:
        finder.locate("w", OPTIM, KEY, 3, 4)
    assert info.value.code == "CK202" and "'exp_avg' of 'w' has 6 elements" in str(info.value)


def test_a_master_outside_its_tensor_is_refused(tmp_path):
    finder = MomentFinder(tmp_path, _States({OPTIM: _zero_file(8)}))
    with pytest.raises(UnsupportedCheckpoint, match="not inside"):
        finder.locate("w", OPTIM, KEY, 5, 4)


def test_a_flat_group_of_two_tensors_is_refused(tmp_path):
    files = {OPTIM: _zero_file(8)}
    files[OPTIM]["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(UnsupportedCheckpoint, match="holds 2 flat tensors"):
        MomentFinder(tmp_path, _States(files)).locate("w", OPTIM, KEY, 0, 4)


def test_fp32_weights_pair_with_the_optimizers_params_in_module_order_or_are_refused(tmp_path):
    """Stage 0 fp32: no master apart from the weight; the client optimizer's entries take the trainable
    parameters (buffers left out) in module order, or nothing is paired. A frozen parameter (one the optimizer does
    not step) is told apart by the shapes of the stepped ones' state (layout/stage0_names.client_moments), or
    nothing is paired."""
    model = {
        "module": {"a": _ref("1", 2), "running": _ref("2", 2), "b": _ref("3", 3)},
        "buffer_names": ["running"],
        "optimizer": {
            "state": {5: {"exp_avg": _ref("4", 2)}, 6: {"exp_avg": _ref("5", 3)}},
            "param_groups": [{"params": [5]}, {"params": [6]}],
        },
    }
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    finder = MomentFinder(tmp_path, _States({"mp_rank_00_model_states.pt": model}))
    found = finder.locate("b", "mp_rank_00_model_states.pt", ["module", "b"], 0, 3)
    assert (found.group, found.ranges) == (1, {"exp_avg": (5000, 12, "float32")})
    model["optimizer"]["param_groups"][1]["params"] = []  # b frozen: the optimizer does not step it
    finder = MomentFinder(tmp_path, _States({"mp_rank_00_model_states.pt": model}))
    found = finder.locate("a", "mp_rank_00_model_states.pt", ["module", "a"], 0, 2)
    assert (found.group, found.ranges) == (0, {"exp_avg": (4000, 8, "float32")})
    with pytest.raises(UnsupportedCheckpoint, match="no optimizer state entry of 'b'"):
        finder.locate("b", "mp_rank_00_model_states.pt", ["module", "b"], 0, 3)
    model["optimizer"]["state"][5]["exp_avg"] = _ref("4", 4)  # a state of no parameter's shape: which one is frozen?
    with pytest.raises(UnsupportedCheckpoint, match="no choice of parameters in module order"):
        MomentFinder(tmp_path, _States({"mp_rank_00_model_states.pt": model})).locate(
            "a", "mp_rank_00_model_states.pt", ["module", "a"], 0, 2
        )

"""``ds_pickle.save_streamed``: torch's file format, each tensor's bytes produced only when written.

The oracle is torch itself: ``torch.load`` of the file gives back every tensor and value, and
ckptspec's restricted reader (what validates reshard's output) reads the same tensors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptspec.checkpoint.states import StateCache  # noqa: E402
from ckptspec.export import ds_pickle  # noqa: E402


def test_lazy_tensors_are_produced_in_order_once_and_read_back_by_torch(tmp_path):
    produced = []

    def make(values, dtype):
        def produce():
            produced.append(len(values))
            return np.asarray(values, dtype=dtype)

        return produce

    step = torch.tensor(7.0)
    obj = {
        "masters": [ds_pickle.Lazy("float32", (2, 3), make(range(6), np.float32))],
        "moments": {0: {"exp_avg": ds_pickle.Lazy("float16", (4,), make([1, 2, 3, 4], np.float16)), "step": step}},
        "bf16": ds_pickle.Lazy("bfloat16", (2,), make([0x3F80, 0xC000], np.uint16)),  # 1.0, -2.0
        "empty": ds_pickle.Lazy("float32", (0,), make([], np.float32)),
        "stage": ds_pickle.zero_stage(3),
        "plain": {"lr": 0.01, "betas": (0.9, 0.999)},
    }
    path = tmp_path / "f.pt"
    ds_pickle.save_streamed(obj, path)
    assert produced == [6, 4, 2, 0]  # each once, when its record was written
    back = torch.load(path, weights_only=False)
    assert torch.equal(back["masters"][0], torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(back["moments"][0]["exp_avg"], torch.tensor([1, 2, 3, 4], dtype=torch.float16))
    assert torch.equal(back["moments"][0]["step"], step)
    assert torch.equal(back["bf16"], torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert back["empty"].shape == (0,) and back["plain"] == obj["plain"] and int(back["stage"]) == 3
    state = StateCache().state(path)  # the restricted reader: no code run
    assert state["masters"][0].shape == (2, 3) and state["bf16"].dtype == "bfloat16"


def test_a_producer_giving_the_wrong_size_is_an_error(tmp_path):
    obj = {"x": ds_pickle.Lazy("float32", (3,), lambda: np.zeros(2, np.float32))}
    with pytest.raises(ValueError, match="produced 8 bytes"):
        ds_pickle.save_streamed(obj, tmp_path / "f.pt")

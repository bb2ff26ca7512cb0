"""The rule of ``layout/stage0_names.stage0_ties`` (issue #40), on hand-made decoded model states: a tie at ZeRO
stage 0 is a module entry that is an earlier entry's very tensor (the same storage, offset, shape and strides); the
later name is the alias. The real checkpoint is tests/export/test_stage0_ties.py's (``s0-bf16-ws2-tied``)."""

from __future__ import annotations

import dataclasses

from ckptspec.checkpoint.torchfile import StorageRef, TensorRef
from ckptspec.deepspeed.layout.stage0_names import stage0_ties


def _ref(key: str, shape: tuple, offset: int = 0, numel: int | None = None) -> TensorRef:
    size = numel if numel is not None else offset + (shape[0] * (shape[1] if len(shape) > 1 else 1) if shape else 1)
    storage = StorageRef(member=f"f/data/{key}", key=key, dtype="bfloat16", itemsize=2, numel=size, location="cpu")
    stride = (shape[1], 1) if len(shape) == 2 else (1,) * len(shape)
    return TensorRef(storage=storage, storage_offset=offset, shape=shape, stride=stride)


def test_the_same_tensor_under_a_later_name_is_its_alias():
    emb = _ref("0", (50, 16))
    model = {"module": {"emb.weight": emb, "l1.weight": _ref("1", (16, 16)), "head.weight": dataclasses.replace(emb)}}
    assert stage0_ties(model) == {"head.weight": "emb.weight"}


def test_views_of_one_storage_that_are_not_the_same_tensor_are_no_tie():
    """A fused weight's halves (one storage, other offsets), or the same bytes seen in another shape."""
    whole = _ref("0", (8, 4), numel=64)
    model = {
        "module": {
            "qkv.a": whole,
            "qkv.b": dataclasses.replace(whole, storage_offset=32),
            "qkv.flat": dataclasses.replace(whole, shape=(32,), stride=(1,)),
        }
    }
    assert stage0_ties(model) == {}


def test_buffers_and_zero_element_tensors_are_never_ties():
    """A buffer is no parameter; zero-element tensors all share DeepSpeed's data_ptr 0 and are no weight."""
    emb, empty = _ref("0", (4, 4)), _ref("1", (0,), numel=0)
    model = {
        "module": {"emb": emb, "running": dataclasses.replace(emb), "e1": empty, "e2": dataclasses.replace(empty)},
        "buffer_names": ["running"],
    }
    assert stage0_ties(model) == {}

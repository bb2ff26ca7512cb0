"""A Megatron-core ``torch_dist`` save read without torch: the committed copy a real Megatron-core job wrote
(tests/data/megatron-core-0.16.1, ``scripts/megatron.sh``): its ``.metadata`` with ``all_local_plans``, its
``metadata.json`` and its ``common.pt`` (restricted reader). Ground truth against Megatron's own load:
tests/dcp/test_megatron.py."""

from __future__ import annotations

from pathlib import Path

from ckptspec.checkpoint.dcp.checks import check_dcp
from ckptspec.checkpoint.dcp.megatron import describe, is_megatron_dir
from ckptspec.checkpoint.dcp.metadata import BytesEntry

CHECKPOINT = Path(__file__).resolve().parents[2] / "data" / "megatron-core-0.16.1" / "checkpoint"


def test_the_committed_save_reads_without_torch():
    assert is_megatron_dir(CHECKPOINT)
    meta, findings = check_dcp(CHECKPOINT)
    assert findings == []
    assert meta.megatron is not None
    assert meta.megatron.config == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert describe(meta.megatron.common) == {
        "iteration": 7,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 7, "decay_style": "cosine"},
    }
    assert [k for k, e in meta.entries.items() if isinstance(e, BytesEntry)] == [
        "rng_state/shard_0_2", "rng_state/shard_1_2"
    ]  # fmt: skip
    stacked = meta.entries["decoder.layers.mlp.linear_fc2.weight"]
    assert stacked.size == (2, 8, 32) and sorted(c.offsets for c in stacked.chunks) == [
        (0, 0, 0), (0, 0, 16), (1, 0, 0), (1, 0, 16)
    ]  # fmt: skip


def test_a_plain_dcp_save_is_not_megatrons(tmp_path):
    assert not is_megatron_dir(tmp_path)

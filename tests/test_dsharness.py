import json

import pytest
from ds_matrix import MATRIX
from dsharness.build import DEEPSPEED_VERSION, build_checkpoint, run_zero_to_fp32

pytestmark = pytest.mark.deepspeed

STAGE2_SPEC = MATRIX["s2-bf16-ws2"][0]  # shared with the other suites: built once


def test_stage2_checkpoint_matches_live_engine(ds_root):
    import torch

    save_dir = build_checkpoint(STAGE2_SPEC, 2, ds_root)

    info = json.loads((save_dir / "harness.json").read_text())
    assert info["deepspeed_version"] == DEEPSPEED_VERSION
    assert (save_dir / "latest").read_text() == info["tag"] == "global_step2"
    assert sorted(p.name for p in (save_dir / info["tag"]).iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
    ]

    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    ref = run_zero_to_fp32(save_dir)
    # Trainable params only (frozen.* and buffers are not in live_fp32.pt), tied alias included.
    assert sorted(live) == ["emb.weight", "head.weight", "l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    for name, tensor in live.items():
        assert tensor.dtype == ref[name].dtype == torch.float32, name
        # Bit-exact: compare the raw bits, so -0.0 vs 0.0 or NaN payloads would count as different.
        assert torch.equal(tensor.view(torch.int32), ref[name].view(torch.int32)), name


def test_cache_hit_returns_same_dir(ds_root):
    first = build_checkpoint(STAGE2_SPEC, 2, ds_root)
    # Spelling out a default value must not change the cache key.
    assert build_checkpoint(dict(STAGE2_SPEC, steps=2), 2, ds_root) == first

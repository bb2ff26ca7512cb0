"""A DeepSpeed ``BF16_Optimizer`` checkpoint whose ``ds_config`` asks for ``round_robin_gradients`` and
``parameter_alignment``: ZeRO's optimizer reorders and pads its flat groups by them, ``BF16_Optimizer`` reads neither
(it lays each group out in module order, without gaps), and the saved ``ds_config`` keeps both. Read as ZeRO's layout,
the checkpoint would fail its own ``param_slice_mappings`` check (CK218) and be resharded in another order.

Ground truth: the real job (``s1-bf16-ws2-bf16opt-rr-align``), which recorded its live engine's manifest on every
rank and its fp32 masters; its reshard to 3 ranks, loaded by the same job config, is a case of test_reshard.py
(``reshard-s1-bf16opt-rr-align-2to3``: masters, moments, step, frozen parameters, buffers, tie, one more step).
"""

from __future__ import annotations

import json

from _harness.reconstruction import check_reconstruction, cli, invoke
from _harness.scenarios import BF16OPT_FLAGS_SPECS

from ckptspec.deepspeed.describe import describe

SOURCE = "s1-bf16-ws2-bf16opt-rr-align"
# what only one producer can know (tests/deepspeed/test_producers.py): who made it, the files, excluded names
PRODUCER_ONLY = ("producer", "files", "excluded")


def test_the_job_asked_for_what_bf16_optimizer_ignores(ds):
    """The premise: the saved ``ds_config`` holds both flags, and the optimizer that saved is BF16_Optimizer's."""
    import torch

    tag = ds.path(SOURCE) / "global_step2"
    model = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    zero = model["ds_config"]["zero_optimization"]
    assert zero["round_robin_gradients"] is True and zero["parameter_alignment"] is True
    optim = torch.load(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    assert "zero_stage" not in optim["optimizer_state_dict"]  # BF16_Optimizer's state_dict records no stage


def test_the_saved_manifest_is_the_live_engines(ds):
    """Described from the directory as the live engine describes itself: module order, no alignment gaps."""
    ranks = BF16OPT_FLAGS_SPECS[SOURCE][1]
    live = [ds.read_json(SOURCE, f"engine_manifest.rank{r}.json") for r in range(ranks)]
    assert all(doc == live[0] for doc in live)
    saved = describe(ds.path(SOURCE)).to_dict()
    saved["optimizer"].pop("class"), live[0]["optimizer"].pop("class")
    assert saved["layout"]["optimizer"] == "BF16_Optimizer"
    assert not saved["layout"]["round_robin"] and not saved["layout"]["parameter_alignment"]
    assert {k: v for k, v in saved.items() if k not in PRODUCER_ONLY} == {
        k: v for k, v in json.loads(json.dumps(live[0])).items() if k not in PRODUCER_ONLY
    }


def test_it_validates_and_reconstructs_the_live_masters(ds, zero_to_fp32, tmp_path):
    """``validate`` passes (each rank's param_slice_mappings are module order's), and every tensor reconstructs to
    the live engine's master bit for bit (zero_to_fp32 refuses BF16_Optimizer checkpoints: asserted)."""
    manifest = tmp_path / "manifest.json"
    cli("generate", ds.path(SOURCE), "-o", manifest)
    result = invoke("validate", manifest, "--checkpoint", ds.path(SOURCE))
    assert result.exit_code == 0, result.output
    check_reconstruction(ds.path(SOURCE), tmp_path / "out", zero_to_fp32, stage=1, zero_to_fp32_reads_it=False)

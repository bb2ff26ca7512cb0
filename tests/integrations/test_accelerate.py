"""accelerate on DeepSpeed (issue #43): ``ckptspec.integrations.accelerate.save_state`` and ``load_state`` in real runs.

The runs are tests/_harness/accelerate_job.py's (scenarios.ACCELERATE_RUNS: ZeRO-2 and ZeRO-3 at world size 2, a
small MLP prepared by ``Accelerator(deepspeed_plugin=...)``, saved at steps 2 and 4; then a copy of step 4 one byte
short, and step 2, loaded). The oracles: the fp32 masters DeepSpeed held at each save and DeepSpeed's
``zero_to_fp32``.
"""

from __future__ import annotations

import json

import pytest
from _harness.reconstruction import same_bits
from _harness.scenarios import ACCELERATE_RUNS

from ckptspec import load_state_dict
from ckptspec.export.api import validate_checkpoint

STEPS = (2, 4)


def _load(path):
    import torch

    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", sorted(ACCELERATE_RUNS))
def test_every_save_carries_its_manifest_and_equals_the_masters(name, ds, zero_to_fp32):
    run = ds.path(name)
    for step in STEPS:
        saved = run / "run" / f"step{step}"
        sidecar = json.loads((saved / "pytorch_model" / "ckptspec.json").read_text())
        files = sorted(p.name for p in (saved / "pytorch_model").iterdir() if p.suffix == ".pt")
        assert sorted(f["path"] for f in sidecar["files"]) == files
        findings = validate_checkpoint(str(saved), tag="pytorch_model", verify_hashes=True)
        assert not [f for f in findings if f.severity == "error"]
        ours = load_state_dict(saved, tag="pytorch_model")
        masters = _load(run / f"masters-step{step}.pt")
        assert sorted(masters) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert all(same_bits(ours[param], master) for param, master in masters.items()), step
        theirs = zero_to_fp32(saved)
        assert sorted(theirs) == sorted(ours) and all(same_bits(ours[k], v) for k, v in theirs.items())


@pytest.mark.parametrize("name", sorted(ACCELERATE_RUNS))
def test_a_damaged_save_is_refused_on_every_rank_before_deepspeed_reads_it(name, ds):
    run = ds.path(name)
    outcomes = json.loads((run / "resume.json").read_text())
    refused = [o["refused"] for o in outcomes]
    assert len(refused) == 2 and refused[0] == refused[1]
    assert refused[0]["raised"] == "CheckpointInvalid" and refused[0]["code"] == "CK208"
    assert refused[0]["findings"][0]["file"].endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    step4 = _load(run / "masters-step4.pt")
    after = _load(run / "after-refused.pt")
    assert all(same_bits(after[param], master) for param, master in step4.items())  # nothing was loaded
    assert [o["loaded"] for o in outcomes] == [{"returned": None}] * 2
    loaded, step2 = _load(run / "loaded-step2.pt"), _load(run / "masters-step2.pt")
    assert all(same_bits(loaded[param], master) for param, master in step2.items())


def test_an_accelerator_without_deepspeed_is_refused_before_anything_runs(tmp_path):
    from accelerate import Accelerator

    from ckptspec.integrations.accelerate import load_state, save_state

    accelerator = Accelerator(cpu=True)
    for call in (save_state, load_state):
        with pytest.raises(ValueError, match="deepspeed_plugin"):
            call(accelerator, str(tmp_path))
    assert list(tmp_path.iterdir()) == []

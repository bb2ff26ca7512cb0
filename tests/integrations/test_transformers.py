"""Hugging Face Trainer on DeepSpeed (issue #43): ``CkptspecCallback`` and ``resume_from`` in real runs.

The runs are tests/_harness/trainer_job.py's (scenarios.TRAINER_RUNS: ZeRO-2 and ZeRO-3 at world size 2, a tiny
GPT-2 trained four steps by ``transformers.Trainer`` with ``deepspeed=``, saved at steps 2 and 4 with the callback;
then a copy whose newest checkpoint lost a byte, resumed). The oracles: the fp32 masters DeepSpeed held at each
save (``safe_get_full_fp32_param``) and DeepSpeed's ``zero_to_fp32`` of the same folder.
"""

from __future__ import annotations

import json
import shutil

import pytest
from _harness.reconstruction import same_bits
from _harness.scenarios import TRAINER_RUNS

from ckptspec import load_state_dict
from ckptspec.errors import CheckpointInvalid, CkptspecError
from ckptspec.export.api import validate_checkpoint

STEPS = (2, 4)  # the saves of every run: checkpoint-2 and checkpoint-4


def _masters(run, name):
    import torch

    return torch.load(run / name, weights_only=True)


@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_every_checkpoint_carries_its_manifest_and_validates_with_hashes(name, ds):
    run = ds.path(name)
    for step in STEPS:
        folder, tag = run / "run" / f"checkpoint-{step}", f"global_step{step}"
        sidecar = json.loads((folder / tag / "ckptspec.json").read_text())
        saved = sorted(p.name for p in (folder / tag).iterdir() if p.suffix == ".pt")
        assert sorted(f["path"] for f in sidecar["files"]) == saved
        assert all(f["hash"]["algorithm"] == "sha256" for f in sidecar["files"])
        assert not [f for f in validate_checkpoint(str(folder), tag=tag, verify_hashes=True) if f.severity == "error"]


@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_reconstruct_is_the_trainers_masters_and_zero_to_fp32_bit_for_bit(name, ds, zero_to_fp32):
    run = ds.path(name)
    for step in STEPS:
        folder = run / "run" / f"checkpoint-{step}"
        ours = load_state_dict(folder, tag=f"global_step{step}")
        masters = _masters(run, f"run-step{step}.pt")
        assert len(masters) == 28
        for param, master in masters.items():
            assert same_bits(ours[param], master), (step, param)
        theirs = zero_to_fp32(folder)
        assert set(theirs) <= set(ours)
        assert all(same_bits(ours[key], value) for key, value in theirs.items())


@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_a_corrupted_newest_checkpoint_is_refused_on_every_rank(name, ds):
    outcomes = json.loads((ds.path(name) / "resume.json").read_text())
    assert len(outcomes) == 2
    refused = [o["refused"] for o in outcomes]
    assert refused[0] == refused[1]  # the same error and findings on both ranks
    assert refused[0]["raised"] == "CheckpointInvalid" and refused[0]["code"] == "CK208"
    assert refused[0]["findings"][0]["file"].endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "checkpoint-4" in refused[0]["text"]
    picked = [o["fallback"] for o in outcomes]
    assert picked[0] == picked[1] and picked[0]["returned"].endswith("/corrupt/checkpoint-2")


@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_the_fallback_resume_loads_the_older_checkpoint_and_replays_the_run(name, ds):
    run = ds.path(name)
    begin, step2 = _masters(run, "resumed-begin.pt"), _masters(run, "run-step2.pt")
    assert all(same_bits(begin[param], master) for param, master in step2.items())
    # no dropout, the Trainer's RNG and data order restored: steps 3 and 4 again give the first run's masters
    again, step4 = _masters(run, "resumed-step4.pt"), _masters(run, "run-step4.pt")
    assert all(same_bits(again[param], master) for param, master in step4.items())
    # the resumed run saved checkpoint-4 again over the truncated files: the callback recorded the new ones
    folder = run / "corrupt" / "checkpoint-4"
    assert not [
        f for f in validate_checkpoint(str(folder), tag="global_step4", verify_hashes=True) if f.severity == "error"
    ]
    assert all(same_bits(load_state_dict(folder, tag="global_step4")[k], v) for k, v in step4.items())


@pytest.fixture
def run_copy(ds, tmp_path):
    """A copy of the ZeRO-2 run's folders (checkpoint-2, checkpoint-4) to damage."""
    copy = tmp_path / "run"
    shutil.copytree(ds.path("trainer-s2-ws2") / "run", copy)
    return copy


def resume_from(*args, **kwargs):
    """ckptspec's, imported when a test calls it: importing transformers takes seconds, and collection imports this
    module in every worker."""
    from ckptspec.integrations.transformers import resume_from

    return resume_from(*args, **kwargs)


def test_resume_from_picks_the_newest_valid_folder_outside_a_job(run_copy):
    """No process group: the same checks, in this process. A checkpoint folder given by name is checked as it is."""
    assert resume_from(run_copy) == str(run_copy / "checkpoint-4")
    assert resume_from(run_copy / "checkpoint-2") == str(run_copy / "checkpoint-2")
    (run_copy / "checkpoint-4" / "latest").unlink()  # the Trainer would pick it, DeepSpeed would load nothing
    with pytest.raises(CheckpointInvalid) as refused:
        resume_from(run_copy)
    assert refused.value.code == "CK261" and "checkpoint-4" in str(refused.value)
    with pytest.warns(UserWarning, match="skipped checkpoint-4: .*CK261"):
        assert resume_from(run_copy, fallback=True) == str(run_copy / "checkpoint-2")


def test_resume_from_a_run_without_a_valid_folder(run_copy, tmp_path):
    """A fresh run (no checkpoint-N) starts from scratch: None; a run whose folders are all damaged is refused (CK260),
    even with fallback; a byte changed in place is found only with ``verify_hashes``."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert resume_from(fresh) is None
    optim = run_copy / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 1
    optim.write_bytes(bytes(data))
    assert resume_from(run_copy / "checkpoint-2") == str(run_copy / "checkpoint-2")
    with pytest.raises(CheckpointInvalid) as refused:
        resume_from(run_copy / "checkpoint-2", verify_hashes=True)
    assert refused.value.code == "CK209"
    shutil.rmtree(run_copy / "checkpoint-4" / "global_step4")
    with pytest.raises(CkptspecError) as none:
        resume_from(run_copy, fallback=True, verify_hashes=True)
    assert none.value.code == "CK260" and "checkpoint-4" in str(none.value) and "checkpoint-2" in str(none.value)


def test_the_callback_refuses_a_trainer_without_deepspeed_before_the_first_step(tmp_path):
    from transformers import TrainingArguments

    from ckptspec.integrations.transformers import CkptspecCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="deepspeed="):
        CkptspecCallback().on_train_begin(args, None, None)

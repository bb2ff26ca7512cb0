"""Which tag the validated resume loads (``ckptspec.deepspeed.load_checkpoint``'s rule, ``deepspeed/load/choice.py``),
on copies of the committed real checkpoint: the tag asked for first, older ones with ``fallback``, newest first;
none newer; each skipped tag's findings under its name. The real 2-rank resume:
tests/deepspeed/test_validated_resume.py.
"""

from __future__ import annotations

import shutil

import pytest

from ckptspec.deepspeed.load.choice import choose
from ckptspec.errors import CkptspecError, NoValidTag

OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


@pytest.fixture
def run(committed, tmp_path):
    """global_step1 good, global_step2 without rank 1's optimizer file, global_step3 with its model states cut short."""
    run = tmp_path / "run"
    for step in (1, 2, 3):
        shutil.copytree(committed("s2-bf16-ws2") / "global_step2", run / f"global_step{step}")
    (run / "global_step2" / OPTIM_1).unlink()
    cut = run / "global_step3" / MODEL
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (run / "latest").write_text("global_step3")
    return run


def test_fallback_loads_the_newest_valid_tag_and_says_what_it_skipped(run):
    verdict = choose(str(run), None, True, True)
    assert verdict["tag"] == "global_step1"
    assert [(s["tag"], s["code"]) for s in verdict["skipped"]] == [("global_step3", "CK205"), ("global_step2", "CK206")]
    missing = verdict["skipped"][1]["findings"]
    assert {f["file"] for f in missing} == {f"global_step2/{OPTIM_1}"}  # under its tag


def test_without_fallback_the_first_tag_is_refused_with_its_findings(run):
    with pytest.raises(NoValidTag) as refused:
        choose(str(run), None, False, True)
    assert refused.value.code == "CK260" and "fallback=True" in refused.value.hint
    assert {f.file.split("/")[0] for f in refused.value.findings} == {"global_step3"}
    assert "CK205" in {f.code for f in refused.value.findings} and "global_step3: CK205" in refused.value.message


def test_a_tag_asked_for_is_tried_first_and_only_older_ones_follow(run):
    assert choose(str(run), "global_step2", True, True) == {
        "tag": "global_step1",
        "skipped": [choose(str(run), None, True, True)["skipped"][1]],
    }
    assert choose(str(run), "global_step1", True, True) == {"tag": "global_step1", "skipped": []}  # step 3 not tried
    shutil.rmtree(run / "global_step1")
    with pytest.raises(NoValidTag) as refused:  # nothing older than global_step2 is valid; global_step3 is newer
        choose(str(run), "global_step2", True, True)
    assert {f.file.split("/")[0] for f in refused.value.findings} == {"global_step2"}


def test_no_valid_tag_raises_the_findings_of_every_tag(run):
    (run / "global_step1" / OPTIM_1).unlink()
    with pytest.raises(NoValidTag) as refused:
        choose(str(run), None, True, True)
    assert refused.value.message.startswith("no valid tag to resume from (global_step3: CK205")
    assert {f.file.split("/")[0] for f in refused.value.findings} == {"global_step1", "global_step2", "global_step3"}


def test_a_flipped_byte_is_caught_by_the_recorded_hashes_only(run, ckptspec_cli):
    """global_step3 made whole again with a sidecar that records every file's SHA-256 (``generate --hash``), then
    one byte of its rank-1 optimizer state flipped (a third into the file: tensor bytes, the zip still parses)."""
    shutil.rmtree(run / "global_step3")
    shutil.copytree(run / "global_step1", run / "global_step3")
    sidecar = run / "global_step3" / "ckptspec.json"
    ckptspec_cli("generate", str(run), "--tag", "global_step3", "--hash", "-o", str(sidecar))
    assert choose(str(run), None, True, True) == {"tag": "global_step3", "skipped": []}
    state = run / "global_step3" / OPTIM_1
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0x01
    state.write_bytes(bytes(data))
    assert choose(str(run), None, True, False) == {"tag": "global_step3", "skipped": []}  # sizes and structure alike
    hashed = choose(str(run), None, True, True)
    assert hashed["tag"] == "global_step1" and [s["code"] for s in hashed["skipped"]] == ["CK209", "CK206"]


@pytest.mark.parametrize("tag", ["global_step9", "latest"])
def test_a_tag_that_is_not_the_runs_is_refused(run, tag):
    with pytest.raises(NoValidTag, match=f"'{tag}' is not a tag of the run") as refused:
        choose(str(run), tag, True, True)
    assert "global_step1, global_step2, global_step3" in refused.value.hint and refused.value.findings == []


def test_an_empty_or_missing_run_is_refused(tmp_path):
    with pytest.raises(NoValidTag, match="no DeepSpeed tag found"):
        choose(str(tmp_path), None, True, True)
    with pytest.raises(CkptspecError) as missing:
        choose(str(tmp_path / "nope"), None, True, True)
    assert missing.value.code == "CK901"


def test_universal_and_trainer_folders_are_not_tags_to_resume_from(committed, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(committed("s2-bf16-ws2") / "global_step2", run / "checkpoint-2" / "global_step2")
    with pytest.raises(NoValidTag, match="only universal or Trainer folders"):
        choose(str(run), None, True, True)
    assert choose(str(run / "checkpoint-2"), None, True, True) == {"tag": "global_step2", "skipped": []}


def test_the_newest_valid_tag_is_loaded_even_where_latest_lags(run):
    """A save stopped between its files and ``latest``: its complete tag is newer than what ``latest`` names, and it
    is the one loaded (``scan``'s newest valid tag), not the older one ``latest`` names."""
    shutil.rmtree(run / "global_step3")
    shutil.rmtree(run / "global_step2")
    shutil.copytree(run / "global_step1", run / "global_step2")
    (run / "latest").write_text("global_step1")
    assert choose(str(run), None, False, True) == {"tag": "global_step2", "skipped": []}


def test_each_tag_is_validated_once_and_none_after_the_first_valid(run, monkeypatch):
    from ckptspec.deepspeed.load import choice

    checked = []
    check_tag = choice.check_tag

    def counted(scan, verify_hashes=False):
        checked.append(scan.name)
        return check_tag(scan, verify_hashes)

    monkeypatch.setattr(choice, "check_tag", counted)
    shutil.copytree(run / "global_step1", run / "global_step0")  # older than the first valid tag: never checked
    assert choose(str(run), None, True, True)["tag"] == "global_step1"
    assert checked == ["global_step3", "global_step2", "global_step1"]

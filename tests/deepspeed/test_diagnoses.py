"""Issue #17's small defects: what older DeepSpeed versions, torch's legacy serialization, subfolders
and legacy MoE names get from ckptspec (../shared/notes/reviews/format-coverage-review.md section 6).

Each starts from a real DeepSpeed checkpoint (committed, or a cached MATRIX one) and rewrites what
the older version wrote differently, as the review found it in DeepSpeed's history: those versions
do not install on this Python (0.5-0.9 need torch < 2), so the edit is the evidence, one key each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
STAGE3_0154 = ROOT / "tests" / "data" / "deepspeed-0.15.4" / "old-s3-bf16-ws2"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in result.output and "CK999" not in result.output, result.output
    return result


def _copy(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A scratch copy of a save directory, and its tag directory."""
    dest = tmp_path / "CKPT"
    shutil.copytree(source, dest, symlinks=False)
    return dest, dest / (dest / "latest").read_text().strip()


def _edit(path: Path, change) -> None:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, path)


def _set_version(tag: Path, version: str) -> None:
    """Every file's ds_version, as a checkpoint of DeepSpeed ``version`` records it."""
    for path in tag.glob("*_model_states.pt"):
        _edit(path, lambda s: s.__setitem__("ds_version", version))
    for path in tag.glob("*_optim_states.pt"):
        _edit(
            path,
            lambda s: (
                s.__setitem__("ds_version", version),
                s["optimizer_state_dict"].__setitem__("ds_version", version),
            ),
        )


def _generate(save_dir: Path, tmp_path: Path) -> dict:
    out = tmp_path / "m.json"
    result = run("generate", save_dir, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_files_in_subfolders_are_listed_as_the_checks_see_them(tmp_path):
    """A subfolder (NVMe offload's ``offloaded_tensors/rank00``, a user's notes) was invisible to
    the producer and CK207 to the checks: the generated manifest lists its files as ``other``."""
    save_dir, tag = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    (tag / "offloaded_tensors" / "rank00").mkdir(parents=True)
    (tag / "offloaded_tensors" / "rank00" / "7.tensor.swp").write_bytes(b"\0" * 64)
    (tag / "notes").mkdir()
    (tag / "notes" / "README").write_text("run 7")
    doc = _generate(save_dir, tmp_path)
    others = {f["path"]: f for f in doc["files"] if f["role"] == "other"}
    assert sorted(others) == ["notes/README", "offloaded_tensors/rank00/7.tensor.swp"]
    assert others["offloaded_tensors/rank00/7.tensor.swp"]["size"] == 64
    result = run("validate", tmp_path / "m.json", "--checkpoint", save_dir)
    assert result.exit_code == 0 and "CK207" not in result.output, result.output
    result = run("validate", save_dir)
    assert result.exit_code == 0 and "CK207" not in result.output, result.output


def test_legacy_torch_serialization_is_named_not_damaged(tmp_path):
    """``checkpoint_serialization: false`` (torch's pre-1.6 format): CK202 naming the format and how
    to re-save, not CK205 "damaged" (the fault suite runs it through validate and the readers)."""
    import torch

    save_dir, tag = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    model = tag / "mp_rank_00_model_states.pt"
    torch.save(torch.load(model, map_location="cpu", weights_only=False), model, _use_new_zipfile_serialization=False)
    result = run("generate", save_dir)
    assert result.exit_code == 1, result.output
    assert "CK202" in result.output and "legacy (non-zip) torch serialization" in result.output
    assert "mp_rank_00_model_states.pt" in result.output and "checkpoint_serialization" in result.output
    assert "CK205" not in result.output and "damaged" not in result.output


def test_deepspeed_0_5_10_layout_is_named(tmp_path):
    """DeepSpeed <= 0.5.10 keeps param_shapes and ds_version in each optimizer file (PR #1732 moved
    them in 0.6.0): named as such, not "is this a DeepSpeed checkpoint?"."""
    save_dir, tag = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    import torch

    shapes = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["param_shapes"]
    _edit(tag / "mp_rank_00_model_states.pt", lambda s: (s.pop("param_shapes"), s.pop("ds_version")))
    for path in tag.glob("*_optim_states.pt"):
        _edit(path, lambda s: s.update(param_shapes=shapes, ds_version="0.5.10"))
    result = run("generate", save_dir)
    assert result.exit_code == 1 and "CK202" in result.output, result.output
    assert "DeepSpeed 0.5.10 checkpoint" in result.output and "optimizer files" in result.output
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in result.output
    assert "is this a DeepSpeed checkpoint" not in result.output


def test_legacy_moe_expert_file_name_is_named_as_moe(tmp_path):
    """``expert_<E>_mp_rank_XX_model_states.pt`` (the name DeepSpeed still loads for MoE layer id
    -1) is an expert file, not a stray file that ends in CK112 on the expert group."""
    save_dir, tag = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    shutil.copyfile(tag / "mp_rank_00_model_states.pt", tag / "expert_0_mp_rank_00_model_states.pt")
    result = run("generate", save_dir)
    assert result.exit_code == 1 and "CK202" in result.output, result.output
    assert "expert_0_mp_rank_00_model_states.pt" in result.output and "MoE" in result.output


def test_stage_1_saved_as_stage_2_by_deepspeed_0_6(ds, tmp_path):
    """DeepSpeed 0.5.9-0.6.7 record ``zero_stage`` 2 in a stage-1 run's optimizer files (fixed in
    0.7.0); ds_config says 1. The manifest says stage 1 and the checks accept the files; from any
    other version the files' stage is taken as written."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    save_dir, tag = _copy(ds.path("s1-bf16-ws2"), tmp_path)
    for path in tag.glob("*_optim_states.pt"):
        _edit(path, lambda s: s["optimizer_state_dict"].__setitem__("zero_stage", ZeroStageEnum.gradients))
    assert _generate(save_dir, tmp_path)["layout"]["zero_stage"] == 2  # 0.19.8 wrote it: the files' word
    _set_version(tag, "0.6.5")
    doc = _generate(save_dir, tmp_path)
    assert doc["layout"]["zero_stage"] == 1 and doc["layout"]["exclude_frozen_parameters"] is False
    assert {f["stored_in"] for f in doc["frozen"]} == {"module"}
    result = run("validate", save_dir)
    assert result.exit_code == 0, result.output
    assert run("reconstruct", save_dir, tmp_path / "out", "--quiet").exit_code == 0


def test_stage_2_before_deepspeed_0_9_1_is_not_said_to_exclude_frozen_parameters(tmp_path):
    """DeepSpeed < 0.9.1 writes no frozen_param_shapes key at all (PR #3205); only a present None
    means exclude_frozen_parameters. At stage 2 the frozen weights are then in ``module``."""
    save_dir, tag = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    before = _generate(save_dir, tmp_path)
    frozen = {f["name"]: f["shape"] for f in before["frozen"]}
    assert frozen, "the committed checkpoint has frozen parameters"
    _edit(tag / "mp_rank_00_model_states.pt", lambda s: (s.pop("frozen_param_shapes"), s.pop("frozen_param_fragments")))
    _set_version(tag, "0.9.0")
    doc = _generate(save_dir, tmp_path)
    assert doc["layout"]["exclude_frozen_parameters"] is False and doc["excluded"] == []
    assert {f["name"]: f["shape"] for f in doc["frozen"]} == frozen
    assert {f["stored_in"] for f in doc["frozen"]} == {"module"}
    result = run("validate", save_dir)
    assert result.exit_code == 0, result.output


def test_stage_3_before_deepspeed_0_9_1_names_the_frozen_weights_it_lost(tmp_path):
    """At stage 3 the same DeepSpeed saved frozen parameters as empty placeholders only: refused
    naming them (CK202), never described as exclude_frozen_parameters."""
    save_dir, tag = _copy(STAGE3_0154, tmp_path)
    for path in tag.glob("*_model_states.pt"):
        _edit(path, lambda s: (s.pop("frozen_param_shapes"), s.pop("frozen_param_fragments")))
    _set_version(tag, "0.9.0")
    result = run("generate", save_dir)
    assert result.exit_code == 1 and "CK202" in result.output, result.output
    assert "were not saved" in result.output and "0.9.0" in result.output

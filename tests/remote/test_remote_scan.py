"""``ckptspec scan`` of a run at an s3:// URL (moto's S3 server, read through s3fs): the local run's verdicts."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from ckptspec.cli import cli

OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _scan(*args) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["scan", *map(str, args), "--format", "json"])
    return result.exit_code, json.loads(result.output)


def test_scan_on_s3_is_scan_on_disk(committed, s3, s3_env, tmp_path):
    run = tmp_path / "scanrun"
    run.mkdir()
    for step in (1, 2):
        shutil.copytree(committed("s2-bf16-ws2") / "global_step2", run / f"global_step{step}")
    (run / "global_step2" / OPTIM_1).unlink()
    (run / "latest").write_text("global_step2")
    url = s3.upload(run)
    code, local = _scan(run)
    remote_code, remote = _scan(url)
    assert code == remote_code == 1 and remote["newest_valid"] == local["newest_valid"] == "global_step1"
    assert remote["problem"] == {**local["problem"], "hint": local["problem"]["hint"].replace(str(run), url)}
    for near, far in zip(local["tags"], remote["tags"], strict=True):
        assert far["saved"] is None  # a listing has sizes, not always times
        assert {**far, "saved": near["saved"]} == near
    refused = CliRunner().invoke(cli, ["scan", url, "--fix-latest"])
    assert refused.exit_code == 2 and "CK916" in refused.output

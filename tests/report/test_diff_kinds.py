"""`ckptspec diff` where A or B is a checkpoint index (MoE, ZeRO stage 0, universal, pipeline, tensor
parallel): real checkpoints of the harness compared across kinds (issue #37, H2: each pair below
was "B can resume from A" with exit 0, and no change table).

What a DeepSpeed job can load is known independently of ckptspec: two models with other parameter
names cannot be loaded strictly into each other; a bf16 job opens ``bf16_zero_pp_rank_*`` files
(CK503, observed in tests/report/test_diff.py's real resumes); at stage 0 an fp32 job's optimizer
cannot load a bf16 job's state (observed: ``resume-stage-0-bf16-to-fp32`` there); a universal
folder has no ZeRO optimizer files (DeepSpeed loads it only with ``checkpoint.load_universal``).
"""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.format.index_models import CheckpointIndex
from ckptspec.report.diff_kinds import resume_reasons

DOCUMENTED = {"a", "b", "valid", "diff_version", "identical", "changes", "resume", "degrees"}


def _folder(ds, name: str, universal: bool = False):
    info = json.loads((ds.path(name) / "parallel.json").read_text())
    return ds.path(name) / (info["universal"]["output_folder"] if universal else info["tag"])


def diff(a, b, *more) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["diff", str(a), str(b), *more, "--format", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, json.loads(result.stdout)


def codes(doc: dict) -> set[str]:
    return {r["code"] for r in doc["resume"]["reasons"]}


# (A, B, a code that must be among the reasons): the pairs of the report, and their neighbours
PAIRS = {
    "plain-vs-stage0-other-model": ("plain:s2-bf16-ws2", "s0-fp32-ws2", "CK504"),
    "moe-vs-plain-other-model": ("moe-ep2-s1-fp32-ws2", "plain:s2-bf16-ws2", "CK504"),
    "moe-fp32-vs-moe-bf16": ("moe-ep2-s1-fp32-ws2", "moe-ep2-s2-bf16-ws2", "CK503"),
    "moe-2-experts-vs-4": ("moe-ep2-s1-fp32-ws2", "moe-ep2-s1-fp32-ws4", "CK504"),
    "stage0-fp32-vs-stage0-bf16": ("s0-fp32-ws2", "s0-bf16-ws2", "CK503"),
    "stage0-vs-moe-stage0": ("s0-fp32-ws2", "moe-ep2-s0-fp32-ws2", "CK504"),
    "universal-vs-its-source": ("universal:uc-s2-bf16-ws2", "uc-s2-bf16-ws2", "CK509"),
}


def _path(ds, spec: str):
    kind, _, name = spec.rpartition(":")
    if kind == "plain":  # a MATRIX entry: the save directory itself
        return ds.path(name)
    return _folder(ds, name, universal=kind == "universal")


@pytest.mark.parametrize("pair", list(PAIRS))
def test_checkpoints_of_other_kinds_cannot_resume(ds, pair):
    a, b, code = PAIRS[pair]
    exit_code, doc = diff(_path(ds, a), _path(ds, b))
    assert exit_code == 1 and doc["resume"]["ok"] is False, doc["resume"]
    assert code in codes(doc), doc["resume"]
    assert DOCUMENTED <= set(doc), sorted(doc)
    assert doc["changes"] and doc["identical"] is False
    assert all(not r["hint"] or "ckptspec reshard A" not in r["hint"] for r in doc["resume"]["reasons"])


@pytest.mark.parametrize("name", ["s0-bf16-ws2", "moe-ep2-s2-bf16-ws4", "pp2-s1-bf16-ws2", "tp2-s1-fp32-ws2"])
def test_a_checkpoint_resumes_itself(ds, name):
    exit_code, doc = diff(_folder(ds, name), _folder(ds, name))
    assert exit_code == 0 and doc["resume"] == {"ok": True, "reasons": []}
    assert doc["identical"] is True and doc["changes"] == [] and doc["diff_version"] == "1.0"


def test_the_text_report_has_the_change_table(ds):
    result = CliRunner().invoke(cli, ["diff", str(_folder(ds, "s0-fp32-ws2")), str(_folder(ds, "s0-bf16-ws2"))])
    lines = result.stdout.splitlines()
    assert result.exit_code == 1
    row = ["layout", "$.domains[0].manifest.layout.model_dtype", "float32", "bfloat16"]
    assert any(line.split() == row for line in lines), result.stdout
    assert any(line.startswith("B: $.domains[0].manifest.layout.model_dtype: CK503 ") for line in lines)
    assert lines[-1] == "resume: B cannot resume from A (1 reason)"


def test_tensor_parallel_world_size_hint_does_not_offer_reshard(ds):
    """L2: reshard refuses tensor/pipeline-parallel checkpoints, so the CK501 hint must not name it."""
    exit_code, doc = diff(_folder(ds, "pp2-s1-bf16-ws2"), _folder(ds, "pp2dp2-s1-bf16-ws4"))
    assert exit_code == 1 and "CK501" in codes(doc)
    assert all("ckptspec reshard A" not in r["hint"] for r in doc["resume"]["reasons"])


# --------------------------------------------------------------------------- one rule on a real index


def _index(ds, name: str) -> dict:
    result = CliRunner().invoke(cli, ["generate", str(_folder(ds, name)), "-o", "-"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ck510_other_domains_with_the_same_names(ds):
    """The same MoE model whose expert domains are named for another expert-parallel size: nothing
    about names explains it, so the domains do (CK510)."""
    a = _index(ds, "moe-ep2-s1-fp32-ws2")
    b = copy.deepcopy(a)
    for d in b["domains"]:
        d["id"] = d["id"].replace("ep_size_2", "ep_size_1")
    found = resume_reasons(CheckpointIndex.model_validate(a), CheckpointIndex.model_validate(b))
    assert [r.code for r in found] == ["CK510"]


def test_stage0_fused_and_unfused_fp16_optimizers_cannot_resume_each_other(ds):
    """Both save fp16 with fp32 masters, but FP16_Optimizer (DeepSpeed's fused Adam) keeps one flat
    master per group and FP16_UnfusedOptimizer one per parameter: each loads the saved state as its
    own inner optimizer's state dict, which torch refuses for the other's groups (the oracle below,
    the first step of DeepSpeed's ``load_state_dict`` in both wrappers)."""
    import torch

    def saved(name):
        state = torch.load(_folder(ds, name) / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return state["optimizer"]

    unfused, fused = saved("s0-fp16-ws2"), saved("s0-fp16-ws2-fused")
    inner_of_fused = torch.optim.Adam([torch.nn.Parameter(t.clone()) for t in fused["fp32_groups_flat"]])
    with pytest.raises(ValueError):
        inner_of_fused.load_state_dict(unfused["optimizer_state_dict"])
    for a, b in (("s0-fp16-ws2", "s0-fp16-ws2-fused"), ("s0-fp16-ws2-fused", "s0-fp16-ws2")):
        exit_code, doc = diff(_folder(ds, a), _folder(ds, b))
        assert exit_code == 1 and codes(doc) == {"CK503"}, doc["resume"]
        assert any(c["kind"] == "layout" and c["path"].endswith(".layout.optimizer") for c in doc["changes"])


def test_a_universal_folder_with_frozen_parameters_needs_load_universal_only(ds):
    """ckptspec's universal folder of a model with frozen parameters, which a real DeepSpeed job of the
    source's layout loaded with load_universal (the harness's resume): CK509 alone, no CK506 for the
    frozen parameters the folder records beside the trainable ones."""
    entry = ds.path("universal-s2-bf16-2to3")
    outcome = json.loads((entry / "resume.json").read_text())
    assert outcome["loaded"] and outcome["frozen_checked"], outcome
    exit_code, doc = diff(entry / "uc", ds.path("s2-bf16-ws2"), "--tag-a", "global_step2_universal")
    assert exit_code == 1 and codes(doc) == {"CK509"}, doc["resume"]

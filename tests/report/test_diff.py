"""`ckptspec diff`: its resume verdict against real DeepSpeed, each rule alone, bad input.

The ground truth is tests/_harness/job/resume.py: a job configured like B (spec, world size,
model change) calls ``engine.load_checkpoint`` on a real checkpoint A and reports whether it
loaded and whether its fp32 masters then equal A's. B's manifest is that job's own layout
(``manifest_from_engine``), so the verdict is computed from what DeepSpeed really built.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from _harness import scenarios
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.format.models import Manifest
from ckptspec.report.diff import RULES, diff_manifests, resume_reasons

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def diff_json(*args) -> tuple[int, dict]:
    result = run("diff", *args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


# --------------------------------------------------------------------------- real DeepSpeed

# case: expected codes; the resume itself is tests/_harness/scenarios.py RESUME_CASES["resume-<case>"]
CASES = {
    "same-layout": set(),
    "world-size-2-to-3-stage2": {"CK501"},
    "world-size-2-to-3-stage3": {"CK501"},
    "stage-2-to-3": {"CK502"},
    "bf16-to-fp16": {"CK503"},
    "added-param": {"CK504"},
    "changed-shape": {"CK505"},
    "round-robin-on": {"CK507"},
    # A is a stage-0 checkpoint (a checkpoint index): B a manifest, or a save of B's own (stage 0)
    "stage-0-same": set(),
    "stage-0-ws2-to-3": set(),
    "stage-0-to-2": {"CK502"},
    "stage-0-bf16-to-fp32": {"CK503"},
}


def _resume(ds, case: str) -> tuple:
    """(A's save directory, B's manifest path, the resume outcome) of a real resume."""
    name = f"resume-{case}"
    saved = ds.path(scenarios.REGISTRY[name].load)
    outcome = ds.read_json(name, "resume.json")
    manifest = ds.path(name) / "manifest.json"
    return saved, manifest if manifest.exists() else ds.path(name) / "layout", outcome


@pytest.mark.parametrize("case", list(CASES))
def test_verdict_matches_deepspeed(case, ds):
    codes = CASES[case]
    saved, manifest_b, outcome = _resume(ds, case)
    resumed = outcome["loaded"] and outcome["consistent"]

    exit_code, result = diff_json(saved, manifest_b)
    assert exit_code == (0 if resumed else 1), (outcome, result["resume"])
    assert result["resume"]["ok"] is resumed
    assert {r["code"] for r in result["resume"]["reasons"]} == codes, outcome
    if case == "round-robin-on":
        # DeepSpeed loads without a word, and the masters are scrambled: why CK507 exists.
        assert outcome["loaded"] and not outcome["consistent"] and outcome["mismatched"]
    if case == "world-size-2-to-3-stage2":
        assert outcome["error"].startswith(
            "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2"
        )
    if case == "world-size-2-to-3-stage3":  # fails before the world-size check, but fails
        assert outcome["error"].startswith("RuntimeError: The size of tensor")


def test_text_report_of_a_real_pair(ds):
    saved, manifest_b, _ = _resume(ds, "world-size-2-to-3-stage2")
    result = run("diff", saved, manifest_b)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert any(line.split() == ["layout", "world_size", "2", "3"] for line in lines)
    assert any(line.startswith("B: $.layout.world_size: CK501 ") and "(hint: " in line for line in lines)
    assert lines[-1] == "resume: B cannot resume from A (1 reason)"


# --------------------------------------------------------------------------- one rule at a time


def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def reasons(a: dict, b: dict) -> list[str]:
    return [r.code for r in resume_reasons(Manifest.model_validate(a), Manifest.model_validate(b))]


def test_identical_manifests_resume():
    a = example()
    assert reasons(a, a) == []
    result = diff_manifests(Manifest.model_validate(a), Manifest.model_validate(a))
    assert result.changes == [] and result.resumable


def test_ck501_world_size():
    b = example()
    b["layout"]["world_size"] = 4
    assert reasons(example(), b) == ["CK501"]


def test_ck501_and_ck502_hints_give_the_reshard_command():
    """The hint names the command that makes the resume possible (docs/reshard.md)."""
    b = example()
    b["layout"]["world_size"] = 4
    (world,) = resume_reasons(Manifest.model_validate(example()), Manifest.model_validate(b))
    assert "`ckptspec reshard A OUTPUT --world-size 4`" in world.hint
    b["layout"]["zero_stage"] = 3
    found = resume_reasons(Manifest.model_validate(example()), Manifest.model_validate(b))
    stage = next(f for f in found if f.code == "CK502")
    assert "`ckptspec reshard A OUTPUT --world-size 4 --stage 3`" in stage.hint
    a = copy.deepcopy(b)  # from stage 3 to 2: reshard reads stage-3 checkpoints too
    stage = next(
        f for f in resume_reasons(Manifest.model_validate(a), Manifest.model_validate(example())) if f.code == "CK502"
    )
    assert "`ckptspec reshard A OUTPUT --world-size 2 --stage 2`" in stage.hint
    zero = example()
    zero["layout"]["zero_stage"] = 0  # stage 0 is neither read nor written: no command
    stage = next(
        f for f in resume_reasons(Manifest.model_validate(a), Manifest.model_validate(zero)) if f.code == "CK502"
    )
    assert "reshard" not in stage.hint


def test_ck502_stage_but_not_between_1_and_2():
    b = example()
    b["layout"]["zero_stage"] = 3
    assert reasons(example(), b) == ["CK502"]
    b["layout"]["zero_stage"] = 1  # same flat layout and files: interchangeable
    assert reasons(example(), b) == []


def test_ck503_bf16_prefix_but_not_fp16_fp32():
    a, b = example(), example()
    b["layout"]["model_dtype"] = "float16"
    assert reasons(a, b) == ["CK503"]
    a["layout"]["model_dtype"] = "float32"
    assert reasons(a, b) == []


def test_ck504_missing_and_unexpected_keys():
    b = example()
    b["buffers"].append({"name": "new_buffer", "shape": [2], "dtype": "float32"})
    del b["aliases"][0]
    found = resume_reasons(Manifest.model_validate(example()), Manifest.model_validate(b))
    assert [r.code for r in found] == ["CK504", "CK504"]
    assert "'new_buffer'" in found[0].message and found[0].path == "$.buffers[2]"
    assert "'head.weight'" in found[1].message


def test_ck504_frozen_parameters_excluded_at_save():
    a, b = example(), example()
    a["frozen"] = []
    a["excluded"] = [
        {"name": "frozen.weight", "reason": "exclude_frozen_parameters"},
        {"name": "frozen.bias", "reason": "exclude_frozen_parameters"},
    ]
    found = resume_reasons(Manifest.model_validate(a), Manifest.model_validate(b))
    assert [r.code for r in found] == ["CK504"] and "exclude_frozen_parameters" in found[0].message


def test_ck505_shape():
    a, b = example(), example()
    b["buffers"][1]["shape"] = [17]
    found = resume_reasons(Manifest.model_validate(a), Manifest.model_validate(b))
    assert [(r.code, r.path) for r in found] == [("CK505", "$.buffers[1].shape")]


def test_ck506_frozen_becomes_trainable():
    a, b = example(), example()
    bias = b["frozen"].pop()
    b["groups"][0]["params"].append(
        {"name": bias["name"], "shape": bias["shape"], "numel": 16, "dtype": "bfloat16", "offset": 1905, "padding": 0}
    )
    assert reasons(a, b) == ["CK506"]
    changes = diff_manifests(Manifest.model_validate(a), Manifest.model_validate(b)).changes
    assert ("unfrozen", "frozen.bias") in {(c.kind, c.name) for c in changes}


def test_ck507_order_alone():
    a, b = example(), example()
    params = b["groups"][0]["params"]
    params[1], params[2] = params[2], params[1]
    found = resume_reasons(Manifest.model_validate(a), Manifest.model_validate(b))
    assert [(r.code, r.path) for r in found] == [("CK507", "$.groups[0].params[1]")]


def test_ck507_is_not_repeated_when_a_root_cause_explains_it():
    b = example()
    b["layout"]["world_size"] = 4
    b["groups"][0]["partition_count"] = 4
    assert reasons(example(), b) == ["CK501"]


def test_changes_name_what_moved():
    a = example()
    b = copy.deepcopy(a)
    b["groups"][0]["params"][0]["dtype"] = "float16"
    b["aliases"][0]["owner"] = "l1.weight"
    b["groups"][0]["optimizer_group"] = 1
    kinds = {(c.kind, c.name) for c in diff_manifests(Manifest.model_validate(a), Manifest.model_validate(b)).changes}
    assert {("retyped", "emb.weight"), ("alias-owner", "head.weight"), ("moved", "l1.weight")} <= kinds


def test_every_rule_has_a_test_here():
    source = Path(__file__).read_text()
    assert all(f"test_{r.code.lower()}" in source for r in RULES)


# --------------------------------------------------------------------------- bad input


def test_invalid_input_is_reported_like_validate():
    bad = ROOT / "tests" / "conformance" / "1.0" / "invalid" / "CK105-alias-zero-size-tie.json"
    result = run("diff", EXAMPLE, bad)
    assert result.exit_code == 1
    assert result.stdout.startswith(f"{bad}: $.aliases[0].shape: CK105 ")


def test_missing_input_is_an_io_error():
    result = run("diff", EXAMPLE, "missing.json")
    assert (
        result.exit_code == 2 and result.output.strip() == "missing.json: CK901 file not found (hint: check the path)"
    )
    exit_code, doc = diff_json("missing.json", EXAMPLE)
    assert exit_code == 2 and doc["error"]["code"] == "CK901"


def test_tag_needs_a_directory():
    result = run("diff", EXAMPLE, EXAMPLE, "--tag-a", "global_step2")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_json_error_keeps_the_shape_of_a_and_b_and_names_the_failing_side(tmp_path):
    """Issue #22, defect 8: `a` and `b` are objects whatever happens; the error says which input failed."""
    _, ok = diff_json(EXAMPLE, EXAMPLE)
    for a, b, side in ((EXAMPLE, "missing", "b"), ("missing", EXAMPLE, "a")):
        exit_code, doc = diff_json(a, b)
        assert exit_code == 2
        assert isinstance(doc["a"], dict) and isinstance(doc["b"], dict), doc
        assert doc["a"]["target"] == str(a) and doc["b"]["target"] == str(b)
        assert doc["error"]["code"] == "CK901"
        # As each finding of an invalid input does, the error names the input it is about.
        assert doc["error"]["target"] == str({"a": a, "b": b}[side]) and doc["error"]["file"] == "missing"
    assert set(ok["a"]) == {"target", "source"}


def test_json_error_names_the_file_text_mode_names(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("../elsewhere")
    text = run("diff", EXAMPLE, save)
    assert text.exit_code == 1 and text.output.startswith(f"{save / 'latest'}: CK201"), text.output
    exit_code, doc = diff_json(EXAMPLE, save)
    assert exit_code == 1
    assert doc["error"]["file"] == str(save / "latest") and doc["error"]["target"] == str(save), doc

"""Producers against real DeepSpeed checkpoints.

For every matrix point: the live engine's manifest (written by every rank from
inside the job) equals the manifest generated from the saved directory, it
validates, and its numbers match what is really in the shard files.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _harness.scenarios import MATRIX, MATRIX_SPECS, engine_name

from ckptspec.deepspeed.describe import describe
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
from ckptspec.format.validate import validate_document

# Fields only one producer can know: who produced it, the files on disk (the engine
# describes the layout before anything is written), and the names dropped by
# exclude_frozen_parameters (DeepSpeed does not record them on disk). Besides, only the engine
# knows the optimizer's class ($.optimizer.class, compared apart).
PRODUCER_ONLY = ("producer", "files", "excluded")


@pytest.fixture(scope="module", params=MATRIX)
def checkpoint(request, ds):
    spec, world_size = MATRIX_SPECS[request.param]
    return request.param, ds.path(request.param), spec, world_size


def _engine_docs(ds, name: str, world_size: int) -> list[dict]:
    """The live engine's manifest, as every rank wrote it inside the job."""
    return [ds.read_json(engine_name(name), f"engine_manifest.rank{r}.json") for r in range(world_size)]


def _without(doc: dict, keys) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


def test_engine_manifest_equals_directory_manifest(checkpoint, ds):
    name, save_dir, spec, world_size = checkpoint
    engine_docs = _engine_docs(ds, name, world_size)
    assert all(doc == engine_docs[0] for doc in engine_docs), "ranks disagree on the engine manifest"
    from_dir = describe(save_dir).to_dict()
    engine = json.loads(json.dumps(engine_docs[0]))
    assert (from_dir["optimizer"].pop("class"), engine["optimizer"].pop("class")) == (
        "unknown",
        "torch.optim.adamw.AdamW",
    )
    assert _without(from_dir, PRODUCER_ONLY) == _without(engine, PRODUCER_ONLY)
    assert engine["format_version"] == "1.1.0" and "optimizer" in engine and "save" in engine


def test_manifests_validate(checkpoint, ds):
    name, save_dir, spec, world_size = checkpoint
    engine_doc = _engine_docs(ds, name, 1)[0]
    for doc in (describe(save_dir).to_dict(), engine_doc):
        report = validate_document(doc)
        assert report.findings == [], [f.to_line() for f in report.findings]


def test_totals_match_shard_files(checkpoint):
    """Every locator names the real flat partition tensor; every size is the real file size."""
    import torch

    name, save_dir, spec, world_size = checkpoint
    manifest = describe(save_dir)
    tag_dir = resolve_tag_dir(save_dir)
    on_disk = {p.name for p in tag_dir.iterdir() if p.is_file()}
    assert {f.path for f in manifest.files} == on_disk
    for shard in manifest.files:
        assert shard.size == (tag_dir / shard.path).stat().st_size
        if shard.role != "optimizer_states":
            continue
        osd = torch.load(tag_dir / shard.path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        flat = osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups")
        assert len(shard.partitions) == len(flat) == len(manifest.groups)
        for loc, tensor in zip(shard.partitions, flat):
            assert loc.numel == tensor.numel() == manifest.groups[loc.group].saved_numels[loc.rank]
            with open(tag_dir / shard.path, "rb") as fh:
                fh.seek(loc.data_offset + loc.element_offset * tensor.element_size())
                raw = fh.read(loc.numel * tensor.element_size())
            assert raw == tensor.detach().contiguous().numpy().tobytes()
    trainable = sum(p.numel for g in manifest.groups for p in g.params)
    live = torch.load(save_dir / "live_fp32.pt", weights_only=False)
    aliases = {a.name for a in manifest.aliases}
    assert trainable == sum(t.numel() for n, t in live.items() if n not in aliases)


def test_every_module_key_has_one_role(checkpoint):
    """Nothing is silently dropped: each state-dict key is trainable, frozen, alias or buffer."""
    import torch

    name, save_dir, spec, world_size = checkpoint
    manifest = describe(save_dir)
    tag_dir = resolve_tag_dir(save_dir)
    model_file = next(f for f in manifest.files if f.role == "model_states")
    module = torch.load(tag_dir / model_file.path, map_location="cpu", weights_only=False)["module"]
    roles = [p.name for g in manifest.groups for p in g.params] + [f.name for f in manifest.frozen]
    roles += [a.name for a in manifest.aliases] + [b.name for b in manifest.buffers]
    assert sorted(roles) == sorted(module)


def test_cli_generate_then_validate(checkpoint, tmp_path):
    name, save_dir, spec, world_size = checkpoint
    out = tmp_path / "manifest.json"
    gen = subprocess.run(
        [sys.executable, "-m", "ckptspec", "generate", str(save_dir), "-o", str(out), "--hash"],
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0, gen.stderr
    val = subprocess.run([sys.executable, "-m", "ckptspec", "validate", str(out)], capture_output=True, text=True)
    assert val.returncode == 0, val.stdout + val.stderr
    doc = json.loads(out.read_text())
    assert all(f["hash"]["algorithm"] == "sha256" for f in doc["files"])


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_malicious_pickle_is_refused_and_never_runs(ds, tmp_path):
    import torch

    save_dir = ds.path("s2-fp16-ws2-groups")
    copy = tmp_path / "ckpt"
    shutil.copytree(save_dir, copy)
    tag_dir = resolve_tag_dir(copy)
    victim = sorted(tag_dir.glob("*optim_states.pt"))[1]
    marker = tmp_path / "pwned"
    state = torch.load(victim, weights_only=False)
    state["client"] = _Evil(str(marker))
    torch.save(state, victim)
    result = subprocess.run([sys.executable, "-m", "ckptspec", "generate", str(copy)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "CK204" in result.stderr and "not allowlisted" in result.stderr and victim.name in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "extra",
    [
        "layer_0_expert_0_mp_rank_00_model_states.pt",
        "layer_01-model_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ],
)
def test_moe_pipeline_and_tensor_parallel_files_are_refused(extra, ds, tmp_path):
    """MoE expert, pipeline layer and model-parallel files: refused by name, never misdescribed.

    The files are copies of a real shard under the names DeepSpeed gives them; a real MoE or
    pipeline run is not part of the matrix.
    """
    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path("s2-bf16-ws2"), copy)
    tag_dir = resolve_tag_dir(copy)
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / extra)
    result = subprocess.run([sys.executable, "-m", "ckptspec", "generate", str(copy)], capture_output=True, text=True)
    assert result.returncode == 1 and "CK202" in result.stderr and extra in result.stderr
    assert "Traceback" not in result.stderr

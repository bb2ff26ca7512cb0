"""Checkpoints written by an older DeepSpeed (0.15.4: no ``param_alignment_paddings``, a pickled
``set`` in the model states).

Default run: the committed checkpoints of ``tests/data/deepspeed-0.15.4/`` (made by
``./scripts/compat.sh --refresh``, each with the fp32 masters read from the live 0.15.4 engine in
the job) validate clean and reconstruct bit-exact against those masters, DeepSpeed 0.19.8's
``zero_to_fp32`` and the model-states files.

Compat tier (``./scripts/compat.sh``, marker ``compat``): the same jobs run again with DeepSpeed
0.15.4 in its own virtualenv; the live engine's manifest equals the directory's, and the
committed checkpoints are what the jobs write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.compat import FIXTURES, OLD_DEEPSPEED_VERSION
from _harness.reconstruction import check_reconstruction
from _harness.scenarios import OLD_DEEPSPEED, OLD_DEEPSPEED_SPECS
from safetensors import safe_open

from ckptspec.deepspeed.describe import describe
from ckptspec.format.validate import validate_document

# Fields only one producer can know (see test_producers.py); only the engine knows the optimizer's class.
PRODUCER_ONLY = ("producer", "files", "excluded")


def _without(doc: dict, keys) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


def test_every_old_checkpoint_is_committed():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == OLD_DEEPSPEED


@pytest.mark.parametrize("name", OLD_DEEPSPEED)
def test_committed_checkpoint_validates_and_reconstructs_bit_exact(ckptspec_cli, zero_to_fp32, name, tmp_path):
    save_dir = FIXTURES / name
    info = json.loads((save_dir / "harness.json").read_text())
    assert info["deepspeed_version"] == OLD_DEEPSPEED_VERSION

    report = json.loads(ckptspec_cli("validate", save_dir, "--format", "json").stdout)
    assert report["valid"] and report["findings"] == []
    doc = describe(save_dir).to_dict()
    assert doc["producer"]["framework_version"] == OLD_DEEPSPEED_VERSION
    assert validate_document(doc).findings == []
    assert "param_alignment_paddings" not in _optimizer_state_keys(save_dir)  # what makes 0.15 different

    check_reconstruction(save_dir, tmp_path / "out", zero_to_fp32, stage=OLD_DEEPSPEED_SPECS[name][0]["stage"])


@pytest.mark.parametrize("name", OLD_DEEPSPEED)
def test_committed_checkpoint_gets_a_complete_1_1_manifest(ckptspec_cli, name, tmp_path):
    """Format 1.1 from DeepSpeed 0.15.4's files: every tensor located, digests that check; the 1.1
    locators point at the bytes torch.load gives; the exported optimizer state is the live engine's."""
    import hashlib

    save_dir = FIXTURES / name
    manifest = describe(save_dir, hash_algorithm="sha256")
    doc = manifest.to_dict()
    assert doc["format_version"] == "1.1.0" and validate_document(doc).findings == []
    assert doc["optimizer"]["groups"] and doc["save"]["global_steps"] == 2
    tag_dir = save_dir / (save_dir / "latest").read_text().strip()
    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    for group in manifest.groups:
        for p in group.params:  # the master digests are the live 0.15.4 engine's values
            assert p.digest.sha256 == hashlib.sha256(live[p.name].contiguous().view(torch.uint8).numpy()).hexdigest()
    stored = {f.name: f.stored_in for f in manifest.frozen}
    for f in manifest.files:
        state = torch.load(tag_dir / f.path, map_location="cpu", weights_only=False)
        for loc in f.tensors or ():
            holder = "module" if stored.get(loc.name, "module") == "module" else "frozen_param_fragments"
            tensor = state[holder][loc.name].reshape(-1)[: loc.numel].contiguous()
            with open(tag_dir / f.path, "rb") as fh:
                fh.seek(loc.data_offset + loc.element_offset * tensor.element_size())
                raw = tensor.view(torch.uint8).numpy().tobytes()
                assert fh.read(len(raw)) == raw, loc.name
    # The optimizer state export against the live 0.15.4 engine's (live_optim.pt, read in the job).
    out = tmp_path / "out"
    ckptspec_cli("reconstruct", save_dir, out, "--quiet", "--optimizer-state")
    live = torch.load(save_dir / "live_optim.pt", weights_only=True)
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["ckptspec.aliases"])
        optimizer = json.loads(f.metadata()["ckptspec.optimizer"])
        for param, by_key in live["state"].items():
            for key, theirs in by_key.items():
                ours = f.get_tensor(f"{aliases.get(param, param)}.{key}")
                assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (param, key)
    assert {g["optimizer_group"]: g["step"] for g in optimizer["groups"]} == live["steps"]
    # DeepSpeed 0.15.4's getter has the same stale links for a second param group as 0.19.8's.
    info = json.loads((save_dir / "harness.json").read_text())
    two_groups = OLD_DEEPSPEED_SPECS[name][0].get("two_groups") and OLD_DEEPSPEED_SPECS[name][0]["stage"] < 3
    assert info["safe_get_full_optimizer_state_stale"] == (["l1.bias", "l2.bias"] if two_groups else [])
    assert info["safe_get_full_optimizer_state_mismatches"] == {"exp_avg": [], "exp_avg_sq": []}


def _optimizer_state_keys(save_dir: Path) -> set:
    tag_dir = save_dir / (save_dir / "latest").read_text().strip()
    first = sorted(tag_dir.glob("*optim_states.pt"))[0]
    return set(torch.load(first, map_location="cpu", weights_only=False)["optimizer_state_dict"])


@pytest.mark.compat
@pytest.mark.parametrize("name", OLD_DEEPSPEED)
def test_old_engine_manifest_equals_directory_manifest(name, ds):
    save_dir = ds.path(name)
    world_size = OLD_DEEPSPEED_SPECS[name][1]
    engine_docs = [ds.read_json(name, f"engine_manifest.rank{r}.json") for r in range(world_size)]
    assert all(doc == engine_docs[0] for doc in engine_docs)
    assert engine_docs[0]["producer"]["framework_version"] == OLD_DEEPSPEED_VERSION
    from_dir = describe(save_dir).to_dict()
    engine = json.loads(json.dumps(engine_docs[0]))
    assert (from_dir["optimizer"].pop("class"), engine["optimizer"].pop("class")) == (
        "unknown",
        "torch.optim.adamw.AdamW",
    )
    assert _without(from_dir, PRODUCER_ONLY) == _without(engine, PRODUCER_ONLY)


@pytest.mark.compat
@pytest.mark.parametrize("name", OLD_DEEPSPEED)
def test_committed_checkpoint_is_what_the_job_writes(name, ds):
    built, committed = ds.path(name), FIXTURES / name
    fresh = torch.load(built / "live_fp32.pt", weights_only=True)
    kept = torch.load(committed / "live_fp32.pt", weights_only=True)
    assert sorted(fresh) == sorted(kept) and all(torch.equal(fresh[k], kept[k]) for k in kept)
    layout = [_without(describe(d).to_dict(), ("producer", "files")) for d in (built, committed)]
    assert layout[0] == layout[1]

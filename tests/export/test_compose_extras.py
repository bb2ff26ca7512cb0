"""Every tensor of a tensor- or pipeline-parallel checkpoint (issue #39, item 3): frozen parameters,
persistent buffers and ties beside the trainable masters, composed as DeepSpeed placed them.

Real AutoTP tp2 jobs (``scenarios.EXTRAS``: ZeRO-1 fp32, frozen weights in the module; ZeRO-2 bf16,
in ``frozen_param_fragments``) whose module freezes a weight AutoTP splits and a bias it leaves whole,
and holds a float and an int buffer. Oracles, all recorded in the job: the live engine's fp32
masters (``safe_get_full_fp32_param``), DeepSpeed's own merge of the module
(``engine._consolidated_16bit_state_dict``, ``consolidated.pt``), each rank's module parameters and
buffers as the forward held them, and the job's logits on a fixed batch. The pipeline
(``pp2-s1-fp32-ws2-extras``) has a frozen weight on stage 0, a buffer on stage 1 and a
``TiedLayerSpec`` run at layer 0 (stage 0) and layer 4 (stage 1).
"""

from __future__ import annotations

import json
import shutil

import pytest
from _harness.job.parallel_models import reference_model, torch_dtype
from _harness.parallel_oracles import affine_pieces, bits_equal, check_masters, info, rank_oracles, shard_of
from _harness.scenarios import EXTRAS

import ckptspec

TP_EXTRAS = [n for n in EXTRAS if n.startswith("tp") and n.endswith("-extras")]
PIPELINE = "pp2-s1-fp32-ws2-extras"
TIED = "tp2-s1-fp32-ws2-tied"  # parallel_models._mlp_net(tied=True): out.weight is inp.weight, AutoTP leaves it whole

FROZEN = ["blocks.0.up.weight", "head.bias"]  # parallel_models._mlp_net(frozen=True): split, whole
BUFFERS = ["running", "step_count"]


def _reconstructed(ckptspec_cli, entry, out):
    from safetensors.torch import load_file

    ckptspec_cli("reconstruct", str(entry), str(out), "--quiet")
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("name", TP_EXTRAS)
def test_the_whole_model_is_the_modules_state_dict(ckptspec_cli, ds, name, tmp_path):
    import torch

    entry = ds.path(name)
    spec = info(entry)["spec"]
    whole = _reconstructed(ckptspec_cli, entry, tmp_path / "out")
    assert list(whole) and set(whole) == set(reference_model(spec).state_dict())

    # Trainables: every rank's live fp32 master is its shard of the output.
    assert check_masters(entry, {n: t for n, t in whole.items() if n not in FROZEN + BUFFERS}) == 2 * 8
    # Frozen: DeepSpeed's own merge of the module, in the training dtype (widened to fp32 by
    # reconstruct, exactly); and each rank's module held its shard of it as DeepSpeed cut it.
    consolidated = torch.load(entry / "consolidated.pt", weights_only=True)
    dt = torch_dtype(spec)
    for frozen in FROZEN:
        assert whole[frozen].dtype == torch.float32
        assert bits_equal(whole[frozen].to(dt), consolidated[frozen]), frozen
        assert bits_equal(whole[frozen].to(dt).float(), whole[frozen]), frozen
    for oracle in rank_oracles(entry):
        tp = oracle["coords"]["tp"]
        for frozen in FROZEN:
            held = oracle["module"][frozen]
            mine = shard_of(consolidated[frozen], affine_pieces(entry, tp, frozen), held.shape)
            assert bits_equal(mine, held), (frozen, tp)
        # Buffers: as every rank's module held them (their own dtype: an int64 counter stays one).
        for buffer in BUFFERS:
            assert bits_equal(whole[buffer], oracle["buffers"][buffer]), (buffer, tp)
    assert whole["step_count"].item() == spec["steps"]

    # The tp1 model with the whole output gives the parallel job's logits (AutoTP's row-parallel
    # layer sums its halves in another order: test_parallel_harness._logit_tolerance).
    model = reference_model(spec).to(dt)
    model.load_state_dict({n: t.to(dt) if t.is_floating_point() else t for n, t in whole.items()}, strict=True)
    model.eval()
    inputs = torch.load(entry / "eval.pt", weights_only=True)["inputs"]
    with torch.no_grad():
        out = model(inputs.to(dt))
    recorded = [o["logits"] for o in rank_oracles(entry)]
    tolerance = 1e-6 if spec["dtype"] == "fp32" else 2**-6
    for logits in recorded:
        assert logits.shape == out.shape and logits.dtype == out.dtype
        assert (logits.float() - out.float()).abs().max().item() <= tolerance

    # load_state_dict reads the same plan: the same names and bytes.
    arrays = ckptspec.load_state_dict(entry, framework="numpy")
    assert set(arrays) == set(whole)
    for n, array in arrays.items():
        assert array.shape == tuple(whole[n].shape), n
        assert array.tobytes() == whole[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), n


@pytest.mark.parametrize("name", TP_EXTRAS)
def test_the_index_places_trainables_and_the_domains_name_the_rest(ckptspec_cli, ds, name, tmp_path):
    """Index 1.0 has no role for frozen parameters or buffers: its parameters are the trainables,
    each domain's manifest names its rank's frozen parameters (local shapes) and buffers."""
    entry = ds.path(name)
    index = ckptspec.describe(entry)
    assert sorted(p.name for p in index.parameters) == sorted(
        {"blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.down.bias", "head.weight"}
        | {f"blocks.1.{n}" for n in ("up.weight", "up.bias", "down.weight", "down.bias")}
    )
    for domain in index.domains:
        frozen = [(f.name, f.shape) for f in domain.manifest.frozen]
        assert frozen == [("blocks.0.up.weight", [16, 16]), ("head.bias", [5])]
        assert [b.name for b in domain.manifest.buffers] == BUFFERS
    ckptspec_cli("validate", str(entry))


def test_replicated_buffers_that_differ_are_refused(ckptspec_cli, ds, tmp_path):
    """A buffer every tensor rank holds whole must be the same on each: one rank's changed, refused by the
    validation ``reconstruct`` starts with (CK237, naming the file), nothing written."""
    import torch

    from ckptspec.errors import CheckpointInvalid

    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path("tp2-s1-fp32-ws2-extras"), copy)
    path = copy / info(copy)["tag"] / "mp_rank_01_model_states.pt"
    states = torch.load(path, map_location="cpu", weights_only=False)
    states["module"]["running"] = states["module"]["running"] + 1
    torch.save(states, path)
    with pytest.raises(CheckpointInvalid) as refused:
        ckptspec.reconstruct(copy, tmp_path / "out")
    [found] = [f for f in refused.value.findings if f.code == "CK237"]
    assert found.file == "mp_rank_01_model_states.pt" and "'running' (buffer)" in found.message
    assert not (tmp_path / "out").exists()


def test_a_pipeline_writes_its_frozen_parameters_buffers_and_ties(ckptspec_cli, ds, tmp_path):
    import torch
    from safetensors import safe_open

    entry = ds.path(PIPELINE)
    spec = info(entry)["spec"]
    whole = _reconstructed(ckptspec_cli, entry, tmp_path / "tied")
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["ckptspec.aliases"])
        sources = json.loads(f.metadata()["ckptspec.sources"])
    assert aliases == {"4.weight": "0.weight"} and "4.weight" not in whole  # stored once, as 1.x stores ties
    # the tied module's frozen gain and buffer: one tensor per layer file (the stages' copies of the buffer differ)
    assert sources["frozen_weight"] == ["0.gain", "2.up.weight", "4.gain"]
    assert sources["buffer"] == ["0.seen", "3.running", "4.seen"]

    ckptspec_cli("reconstruct", str(entry), str(tmp_path / "untied"), "--untie", "--quiet")
    from safetensors.torch import load_file

    untied = load_file(tmp_path / "untied" / "model.safetensors")
    assert set(untied) == set(reference_model(spec).state_dict()) == set(whole) | {"4.weight"}
    assert bits_equal(untied["4.weight"], untied["0.weight"])
    # Trainables, the tie included: each stage's live master (both stages train the tied weight).
    oracles = rank_oracles(entry)
    assert [o["masters"].keys() >= {"tied_modules.emb.weight"} for o in oracles] == [True, True]
    assert check_masters(entry, untied) == 4 + 7
    # The frozen weight as stage 0's module held it (no master exists), the buffer as stage 1's.
    assert bits_equal(untied["2.up.weight"], oracles[0]["module"]["2.up.weight"])
    assert "2.up.weight" not in oracles[0]["masters"]
    assert bits_equal(untied["3.running"], oracles[1]["buffers"]["3.running"])
    assert untied["3.running"].abs().sum() > 0  # the training forward moved it
    # The tied module's gain and buffer as each stage's module held them: layer 0's stage 0's, layer 4's stage 1's.
    for stage, layer in enumerate((0, 4)):
        assert bits_equal(untied[f"{layer}.gain"], oracles[stage]["module"]["tied_modules.emb.gain"])
        assert bits_equal(untied[f"{layer}.seen"], oracles[stage]["buffers"]["tied_modules.emb.seen"])
    assert not bits_equal(untied["0.seen"], untied["4.seen"])
    # The tp1 model (one Linear at layers 0 and 4) with the output gives the last stage's logits, bit for bit.
    model = reference_model(spec)
    model.load_state_dict(untied, strict=True)
    model.eval()
    inputs = torch.load(entry / "eval.pt", weights_only=True)["inputs"]
    with torch.no_grad():
        out = model(inputs)
    (logits,) = [o["logits"] for o in oracles if o["logits"] is not None]
    assert bits_equal(logits, out)
    # load_state_dict: every name, the tie too.
    arrays = ckptspec.load_state_dict(entry, framework="numpy")
    assert set(arrays) == set(untied)
    for n, array in arrays.items():
        assert array.tobytes() == untied[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), n


def test_a_pipeline_buffer_missing_from_its_layer_file_is_refused(ds, tmp_path):
    """The stage's model states name the buffer (``buffer_names``); a layer file without it is refused
    before anything is written (CK401), never a model without it."""
    import torch

    from ckptspec.errors import ReconstructMismatch

    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path(PIPELINE), copy)
    path = copy / info(copy)["tag"] / "layer_03-model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    del state["running"]
    torch.save(state, path)
    with pytest.raises(ReconstructMismatch, match=r"stage 1's model states name buffers \['3.running'\]"):
        ckptspec.reconstruct(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _model_states(entry, mp: int):
    return entry / info(entry)["tag"] / f"mp_rank_{mp:02d}_model_states.pt"


def test_an_autotp_tie_is_described_once_and_written_as_deepspeed_holds_it(ckptspec_cli, ds, tmp_path):
    """Two Linear layers sharing one weight AutoTP leaves whole (the one tie AutoTP 0.19.8 trains: it fails
    on, or slices the other use of, a split tied weight). DeepSpeed records ``shared_params`` on global rank
    0 only: tensor rank 1's model states hold ``{}`` and save ``out.weight`` as one more key on
    ``inp.weight``'s very bytes, which is what makes it the same tie there."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    entry = ds.path(TIED)
    spec = info(entry)["spec"]
    recorded = [torch.load(_model_states(entry, mp), map_location="cpu", weights_only=False) for mp in (0, 1)]
    assert [r["shared_params"] for r in recorded] == [{"out.weight": "inp.weight"}, {}]  # DeepSpeed's own record
    index = ckptspec.describe(entry)
    for domain in index.domains:
        assert [(a.name, a.owner) for a in domain.manifest.aliases] == [("out.weight", "inp.weight")]
        assert domain.manifest.frozen == []
    (owner,) = [p for p in index.parameters if p.name == "inp.weight"]
    assert [s.placement for s in owner.shards] == ["replicated", "replicated"]
    assert "out.weight" not in {p.name for p in index.parameters}
    ckptspec_cli("validate", str(entry))

    whole = _reconstructed(ckptspec_cli, entry, tmp_path / "tied")
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckptspec.aliases"]) == {"out.weight": "inp.weight"}
    assert "out.weight" not in whole  # stored once
    ckptspec_cli("reconstruct", str(entry), str(tmp_path / "untied"), "--untie", "--quiet")
    untied = load_file(tmp_path / "untied" / "model.safetensors")
    assert set(untied) == set(reference_model(spec).state_dict()) == set(whole) | {"out.weight"}
    assert bits_equal(untied["out.weight"], untied["inp.weight"])
    # Every rank's live fp32 master (the tie has one: inp.weight), and DeepSpeed's own merge of the module.
    oracles = rank_oracles(entry)
    assert ["out.weight" not in o["masters"] and "inp.weight" in o["masters"] for o in oracles] == [True, True]
    assert check_masters(entry, untied) == sum(len(o["masters"]) for o in oracles) == 2 * 11
    consolidated = torch.load(entry / "consolidated.pt", weights_only=True)
    assert set(consolidated) == set(untied)
    assert all(bits_equal(untied[n], consolidated[n]) for n in untied)
    # The tp1 model (one weight at inp and out) with the output gives the job's logits.
    model = reference_model(spec)
    model.load_state_dict(untied, strict=True)
    assert model.out.weight is model.inp.weight
    model.eval()
    inputs = torch.load(entry / "eval.pt", weights_only=True)["inputs"]
    with torch.no_grad():
        out = model(inputs)
    for logits in (o["logits"] for o in oracles):
        assert (logits - out).abs().max().item() <= 1e-6
    arrays = ckptspec.load_state_dict(entry, framework="numpy")
    assert set(arrays) == set(untied)


def test_an_autotp_tie_is_never_taken_on_trust(ds, tmp_path):
    """Rank 0's ``shared_params`` name the tie; another tensor rank's own bytes must prove it. A copy of the
    weight there (not the owner's tensor) is a module key without a merge rule (CK202), and a recorded tie
    of a weight AutoTP splits is refused by name: nothing is described, nothing written."""
    import torch

    from ckptspec.errors import UnsupportedCheckpoint

    for mp, change, message in [
        (1, lambda s: s["module"].update({"out.weight": s["module"]["out.weight"].clone()}), "'out.weight'"),
        (0, lambda s: s.update(shared_params={"out.weight": "blocks.0.up.weight"}), "splits the tied weight"),
    ]:
        copy = tmp_path / f"ckpt{mp}"
        shutil.copytree(ds.path(TIED), copy)
        path = _model_states(copy, mp)
        states = torch.load(path, map_location="cpu", weights_only=False)
        change(states)
        torch.save(states, path)
        with pytest.raises(UnsupportedCheckpoint, match=message) as raised:
            ckptspec.describe(copy)
        assert raised.value.code == "CK202"
        with pytest.raises(UnsupportedCheckpoint):
            ckptspec.reconstruct(copy, tmp_path / f"out{mp}")
        assert not (tmp_path / f"out{mp}").exists()


@pytest.mark.parametrize("name", TP_EXTRAS)
def test_the_readers_placements_are_the_index_s(ckptspec_cli, ds, name, tmp_path):
    """`generate` writes a checkpoint index 1.1 that places every frozen parameter and buffer (``extras``), and
    `reconstruct` follows the document, not its own derivation: the tensor ranks' blocks of the frozen split
    weight swapped in the document (still a valid tiling) come out swapped, everything else unchanged."""
    from safetensors.numpy import load_file

    entry = ds.path(name)
    tag = entry / info(entry)["tag"]
    index = tmp_path / "index.json"
    ckptspec_cli("generate", str(tag), "-o", str(index))
    doc = json.loads(index.read_text("utf-8"))
    assert doc["format_version"] == "1.1.0"
    assert {e["name"]: e["role"] for e in doc["extras"]} == {
        **dict.fromkeys(FROZEN, "frozen"),
        **dict.fromkeys(BUFFERS, "buffer"),
    }
    ckptspec_cli("reconstruct", "-q", "--manifest", str(index), str(tag), str(tmp_path / "as-saved"))
    extra = next(e for e in doc["extras"] if e["name"] == "blocks.0.up.weight")
    a, b = (s["placement"]["split"] for s in extra["shards"])
    a["offset"], b["offset"] = b["offset"], a["offset"]
    index.write_text(json.dumps(doc), "utf-8")
    ckptspec_cli("reconstruct", "-q", "--manifest", str(index), str(tag), str(tmp_path / "swapped"))
    saved = load_file(tmp_path / "as-saved" / "model.safetensors")
    swapped = load_file(tmp_path / "swapped" / "model.safetensors")
    half = saved["blocks.0.up.weight"].shape[0] // 2
    w = saved["blocks.0.up.weight"]
    assert swapped["blocks.0.up.weight"].tobytes() == w[half:].tobytes() + w[:half].tobytes() != w.tobytes()
    assert {k: v.tobytes() for k, v in swapped.items() if k != "blocks.0.up.weight"} == {
        k: v.tobytes() for k, v in saved.items() if k != "blocks.0.up.weight"
    }

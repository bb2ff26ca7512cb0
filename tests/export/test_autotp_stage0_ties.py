"""#40: an AutoTP checkpoint saved at ZeRO stage 0 with a tie (the AutoTP MLP whose ``out.weight`` is ``inp.weight``, a
weight AutoTP leaves whole). DeepSpeed records no ``shared_params`` at stage 0: each tensor rank's module holds the one
tensor under both names. ckptspec reads the tie in every tensor rank's domain as it reads a data-parallel stage-0
checkpoint's (``stage0_names.stage0_ties``), where it used to refuse the checkpoint (CK202); no job has loaded a
resharded one yet, so every move of it is refused by name (CK410).

Ground truth: the real job ``tp2-s0-bf16-ws2-tied`` (tp2 x dp1, FP16_UnfusedOptimizer), its ranks' live fp32 masters
(``oracle.rank*.pt``) put together over the tensor ranks by the whole shapes the job recorded.
"""

from __future__ import annotations

import pytest
import torch
from _harness.parallel_oracles import bits_equal, info, merged, rank_oracles
from _harness.reconstruction import cli, invoke

import ckptspec

SOURCE = "tp2-s0-bf16-ws2-tied"
ALIAS, OWNER = "out.weight", "inp.weight"


def test_each_tensor_rank_saved_one_tensor_under_two_names(ds):
    """The premise: no shared_params; in each tensor rank's module ``out.weight`` is ``inp.weight``'s very tensor."""
    tag = ds.path(SOURCE) / info(ds.path(SOURCE))["tag"]
    for mp in (0, 1):
        states = torch.load(tag / f"mp_rank_{mp:02d}_model_states.pt", map_location="cpu", weights_only=False)
        assert states["shared_params"] is None
        assert states["module"][ALIAS].data_ptr() == states["module"][OWNER].data_ptr()


def test_the_tie_is_an_alias_in_every_tensor_ranks_domain(ds):
    result = invoke("validate", ds.path(SOURCE))
    assert result.exit_code == 0, result.output
    index = ckptspec.open(ds.path(SOURCE))
    assert len(index.domains) == 2
    for domain in index.domains:
        assert [(a.name, a.owner, a.shape) for a in domain.manifest.aliases] == [(ALIAS, OWNER, [16, 16])]
        assert domain.manifest.frozen == []
    assert ALIAS not in {p.name for p in index.document.parameters}


def test_it_reconstructs_the_live_masters(ds, tmp_path):
    """The whole model is the live engine's fp32 masters bit for bit, the tie stored once and named an alias;
    ``--untie`` writes it under both names."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    shapes = {n: tuple(s) for n, s in info(ds.path(SOURCE))["global_shapes"].items()}
    live = merged(rank_oracles(ds.path(SOURCE)), lambda o: o["masters"], shapes)
    cli("reconstruct", ds.path(SOURCE), tmp_path / "out", "--quiet")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(live) and OWNER in live and ALIAS not in live
    assert [n for n in live if not bits_equal(got[n], live[n])] == []
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata()["ckptspec.aliases"] == '{"out.weight": "inp.weight"}'
    cli("reconstruct", ds.path(SOURCE), tmp_path / "untied", "--quiet", "--untie")
    untied = load_file(tmp_path / "untied" / "model.safetensors")
    assert bits_equal(untied[ALIAS], live[OWNER])


@pytest.mark.parametrize(
    "args",
    [
        ("reshard", "--world-size", "4"),  # stage 0 at its tensor degree
        ("reshard", "--world-size", "4", "--stage", "2"),
        ("reshard", "--world-size", "2", "--tensor-parallel", "1", "--stage", "1"),
        ("reshard", "--world-size", "4", "--tensor-parallel", "4", "--stage", "0"),
        ("export-universal",),
    ],
    ids=["stage0-ws4", "zero2-ws4", "merged-zero1", "split-stage0", "universal"],
)
def test_every_move_is_refused_by_name_and_nothing_written(ds, tmp_path, args):
    command, *options = args
    result = invoke(command, ds.path(SOURCE), tmp_path / "out", *options)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and "tied parameters (out.weight of inp.weight)" in result.output, result.output
    assert not (tmp_path / "out").exists()

"""#39: ``export --format dcp`` of a checkpoint of any kind at a URL (nginx) writes what it writes from the
local copy: the same keys, every tensor bit for bit (the ``.metadata`` pickle itself differs: it records
the run's own checkpoint id)."""

from __future__ import annotations

import pytest
from _harness.parallel_oracles import read_dcp
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.cli import cli

# tensor x data parallel (ZeRO-2), MoE expert-parallel 2 at stage 0 (moments located in the optimizer files),
# and a plain ZeRO-2 checkpoint (the one path of every kind: plan_dcp over ckptspec.open)
NAMES = ["tp2dp2-s2-bf16-ws4", "moe-ep2-s0-bf16-ws4", "committed:s2-bf16-ws2"]


@pytest.mark.parametrize("name", NAMES)
def test_export_dcp_from_a_url_is_the_local_export(nginx, ds, name, tmp_path):
    import torch

    source = COMMITTED[name.removeprefix("committed:")] if name.startswith("committed:") else ds.path(name)
    local, path = nginx.serve(source)
    for source, out in ((local, "local"), (nginx.url(path), "remote")):
        result = CliRunner().invoke(cli, ["export", str(source), str(tmp_path / out), "--quiet"])
        assert result.exit_code == 0, result.output
    ours, theirs = read_dcp(tmp_path / "remote"), read_dcp(tmp_path / "local")
    assert sorted(ours) == sorted(theirs) and any(k.startswith("optim.state.") for k in ours)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype, key
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key

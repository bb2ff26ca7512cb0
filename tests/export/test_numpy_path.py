"""The torch-free path: reconstruction with only numpy, torch not importable.

For every matrix point a subprocess blocks ``import torch`` (and deepspeed and
safetensors, which the numpy path does not need either) with a ``sys.meta_path``
finder, runs ``ckptspec reconstruct`` (fp32 and bf16) and
``ckptspec.load_state_dict(framework="numpy")``. Its output files must be
byte-identical to those of a normal run, and its values must equal, bit for bit,
DeepSpeed's ``zero_to_fp32`` (cast with torch for bf16), the live engine's fp32 masters and the
torch API.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _harness.scenarios import MATRIX, MATRIX_SPECS

BLOCKED = ("torch", "deepspeed", "safetensors")

TORCH_FREE_RUN = textwrap.dedent("""
    import importlib.abc, json, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("torch is importable: the test is broken")

    import numpy as np
    import ckptspec
    from ckptspec.cli import main

    checkpoint, out = sys.argv[1], sys.argv[2]
    for dtype in ("fp32", "bf16"):
        sys.argv = ["ckptspec", "reconstruct", checkpoint, f"{{out}}/{{dtype}}", "--quiet", "--dtype", dtype]
        try:
            main()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise SystemExit(f"reconstruct --dtype {{dtype}} exited {{exc.code}}")
    state = ckptspec.load_state_dict(checkpoint, framework="numpy")
    np.savez(f"{{out}}/state.npz", **{{k.replace(".", "/"): v for k, v in state.items()}})
    json.dump({{"order": list(state),
               "modules": sorted(m.split(".")[0] for m in sys.modules if m.split(".")[0] in {blocked!r})}},
              open(f"{{out}}/run.json", "w"))
""").format(blocked=BLOCKED)


@pytest.fixture(scope="module", params=MATRIX)
def checkpoint(request, ds):
    return request.param, ds.path(request.param), MATRIX_SPECS[request.param][0]


def test_numpy_only_gives_the_same_bits(ckptspec_cli, zero_to_fp32, checkpoint, tmp_path):
    import numpy as np
    import torch

    import ckptspec

    name, save_dir, spec = checkpoint
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_RUN, str(save_dir), str(blocked)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = json.loads((blocked / "run.json").read_text())
    assert run["modules"] == [], "nothing imported torch, deepspeed or safetensors"

    # Byte-identical files to a normal run (in this process, where torch is importable).
    normal = tmp_path / "normal"
    for dtype in ("fp32", "bf16"):
        ckptspec_cli("reconstruct", save_dir, normal / dtype, "--quiet", "--dtype", dtype)
        assert sorted(p.name for p in (blocked / dtype).iterdir()) == sorted(p.name for p in (normal / dtype).iterdir())
        for path in (normal / dtype).iterdir():
            assert (blocked / dtype / path.name).read_bytes() == path.read_bytes(), f"{dtype}/{path.name} differs"

    # The numpy API equals the torch API, bit for bit and key for key.
    as_numpy = {k.replace("/", "."): v for k, v in np.load(blocked / "state.npz").items()}
    as_torch = ckptspec.load_state_dict(save_dir, framework="torch")
    assert run["order"] == list(as_torch)
    for key, tensor in as_torch.items():
        assert tuple(tensor.shape) == as_numpy[key].shape, key
        assert tensor.contiguous().numpy().tobytes() == as_numpy[key].tobytes(), key

    # And the torch-free files equal DeepSpeed's own results (bf16 cast by torch): the live engine's
    # masters, and zero_to_fp32's whole state dict (it cannot read BF16_Optimizer checkpoints: that
    # refusal is asserted in test_reconstruct.py). Every key is compared; an alias through its owner.
    from safetensors import safe_open
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch  # safetensors.numpy cannot read BF16

    reference = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    assert reference
    if spec.get("grad_accum_dtype") != "fp32":
        whole = zero_to_fp32(save_dir)
        assert whole and all(torch.equal(whole[k], v) for k, v in reference.items())
        reference = whole
    fp32 = load_file(blocked / "fp32" / "model.safetensors")
    bf16 = load_torch(blocked / "bf16" / "model.safetensors")
    with safe_open(blocked / "fp32" / "model.safetensors", framework="numpy") as f:
        aliases = json.loads(f.metadata()["ckptspec.aliases"])
    for key, theirs in reference.items():
        key = aliases.get(key, key)  # a tied alias is stored once, under its owner
        assert key in fp32, f"{key}: in DeepSpeed's state dict, not in the torch-free output"
        if theirs.numel() == 0:
            assert fp32[key].size == 0
            continue
        theirs = theirs.detach()
        wide = theirs.float() if theirs.is_floating_point() else theirs
        assert fp32[key].tobytes() == wide.contiguous().numpy().tobytes(), key
        narrow = theirs.to(torch.bfloat16) if theirs.is_floating_point() else theirs
        assert bf16[key].dtype == narrow.dtype, key
        assert torch.equal(
            bf16[key].reshape(-1).view(torch.uint8), narrow.contiguous().reshape(-1).view(torch.uint8)
        ), key

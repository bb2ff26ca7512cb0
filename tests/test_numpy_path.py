"""The torch-free path (issue #5): reconstruction with only numpy, torch not importable.

For every matrix point a subprocess blocks ``import torch`` (and deepspeed and
safetensors, which the numpy path does not need either) with a ``sys.meta_path``
finder, runs ``ckptspec reconstruct`` (fp32 and bf16) and
``ckptspec.load_state_dict(framework="numpy")``. Its output files must be
byte-identical to those of a normal run, and its values must equal, bit for bit,
DeepSpeed's ``zero_to_fp32`` (cast with torch for bf16) and the torch API.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap

import pytest
from ds_matrix import MATRIX
from dsharness.build import build_checkpoint, run_zero_to_fp32

pytestmark = pytest.mark.deepspeed

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


@pytest.fixture(scope="module", params=sorted(MATRIX))
def checkpoint(request, ds_root):
    spec, world_size = MATRIX[request.param]
    return request.param, build_checkpoint(spec, world_size, ds_root), spec


def _quiet_zero_to_fp32(save_dir):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return run_zero_to_fp32(save_dir)


def test_numpy_only_gives_the_same_bits(checkpoint, tmp_path):
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

    # Byte-identical files to a normal run (where torch is importable).
    normal = tmp_path / "normal"
    for dtype in ("fp32", "bf16"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptspec",
                "reconstruct",
                str(save_dir),
                str(normal / dtype),
                "--quiet",
                "--dtype",
                dtype,
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
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

    # And the torch-free files equal DeepSpeed's own result (bf16 cast by torch).
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch  # safetensors.numpy cannot read BF16

    try:
        reference = _quiet_zero_to_fp32(save_dir)
    except ValueError:  # BF16_Optimizer: zero_to_fp32 cannot read it (tested in test_reconstruct.py)
        reference = {}
    fp32 = load_file(blocked / "fp32" / "model.safetensors")
    bf16 = load_torch(blocked / "bf16" / "model.safetensors")
    for key, theirs in reference.items():
        if key not in fp32:  # a tied alias, stored once
            continue
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

"""The examples in examples/ run end to end and give what they claim, on real DeepSpeed output.

* examples/hf_gpt2/run.sh: trains a tiny transformers GPT-2 with DeepSpeed ZeRO-2 (bf16, 2 ranks),
  saving with ckptspec's hook (examples/hf_gpt2/train.py), then validates, reconstructs and loads
  the weights with ``from_pretrained`` (examples/hf_gpt2/load.py). One DeepSpeed run.
* examples/load_numpy.py: reads reconstructions of a cached matrix checkpoint with numpy alone.

Both are checked against the live engine's fp32 master weights, not against ckptspec.
"""

from __future__ import annotations

import importlib.util
import json
import pickletools
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _example_module(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


# --------------------------------------------------------------------------- Hugging Face GPT-2


def _run_hf_example(directory: Path, env: dict) -> None:
    out = directory / "run"
    # run.sh's python, torchrun and ckptspec come first on PATH (the harness's env, launch.job_env).
    result = subprocess.run(
        ["bash", str(ROOT / "examples/hf_gpt2/run.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if result.returncode != 0:
        raise RuntimeError(f"examples/hf_gpt2/run.sh failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    # The run's own output directory is named in its output; the cached copy lives elsewhere.
    (directory / "stdout.txt").write_text(result.stdout.replace(str(out), "{out}"))


@pytest.fixture(scope="module")
def hf_run(ds):
    """examples/hf_gpt2/run.sh end to end (train, save, validate, reconstruct, load), cached on what it
    runs: the example's files, transformers' version (and, by the harness, the rest, ckptspec's
    modules its processes import included)."""
    from importlib.metadata import version

    identity = {"transformers": version("transformers")}
    entry = ds.cached("hf_gpt2", identity, _run_hf_example, sources=[ROOT / "examples" / "hf_gpt2"])
    out = entry / "run"
    return out, (entry / "stdout.txt").read_text().replace("{out}", str(out))


def test_hf_gpt2_runs_and_loads_bit_exact(hf_run):
    out, stdout = hf_run
    assert stdout.splitlines() == [
        f"saved {out}/checkpoint: ZeRO-2, 3 files described",
        f"{out}/checkpoint: valid",
        f"{out}/hf: 29 tensors bit-identical to the live engine's fp32 masters "
        "(aliases {'lm_head.weight': 'transformer.wte.weight'}); logits equal",
    ], stdout


def test_hf_gpt2_checkpoint_carries_its_manifest_and_the_tie(hf_run):
    from safetensors import safe_open

    out, _ = hf_run
    sidecar = json.loads((out / "checkpoint" / "global_step2" / "ckptspec.json").read_text())
    assert sidecar["layout"]["zero_stage"] == 2 and sidecar["layout"]["model_dtype"] == "bfloat16"
    assert sidecar["aliases"] == [{"name": "lm_head.weight", "owner": "transformer.wte.weight", "shape": [64, 16]}]

    # Independently of load.py: the file holds the live engine's masters, the tie stored once.
    reference = {}
    with safe_open(out / "reference.safetensors", framework="numpy") as f:
        reference = {k.removeprefix("master."): f.get_tensor(k) for k in f.keys() if k.startswith("master.")}
    with safe_open(out / "hf" / "model.safetensors", framework="numpy") as f:
        assert json.loads(f.metadata()["ckptspec.aliases"]) == {"lm_head.weight": "transformer.wte.weight"}
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(stored) == sorted(reference) and len(stored) == 28
    differ = [k for k in reference if stored[k].dtype != np.float32 or _bits(stored[k]) != _bits(reference[k])]
    assert not differ


def test_hf_gpt2_load_refuses_a_changed_weight(hf_run, tmp_path, capsys):
    """load.py's comparison can fail: one changed element in a copy of the output is reported."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out, _ = hf_run
    copy = tmp_path / "hf"
    shutil.copytree(out / "hf", copy)
    with safe_open(copy / "model.safetensors", framework="numpy") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k).copy() for k in f.keys()}
    bias = tensors["transformer.h.1.mlp.c_fc.bias"]
    bias[3] = np.nextafter(bias[3], np.float32(1))  # one ulp
    save_file(tensors, str(copy / "model.safetensors"), metadata=metadata)
    # In this process: a second `import transformers` in a fresh one would cost more than the check.
    load = _example_module("examples/hf_gpt2/load.py")
    assert load.main(str(copy), str(out / "reference.safetensors")) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{copy}: differs from the live engine: ['transformer.h.1.mlp.c_fc.bias']"
    ]


def test_hf_gpt2_checkpoint_scans_the_same_through_the_fast_lane(hf_run, monkeypatch):
    """The opcode scan's fast lanes (``checkpoint/torch_records``) on real DeepSpeed output: they take
    the state dict's and ``param_shapes``' records whole (one at a time, or a run together) and end
    where the walk one opcode at a time ends (memo, stack and marks)."""
    from ckptspec.checkpoint import pickle_scan, torch_records

    out, _ = hf_run
    spans, real = [], torch_records.named_record

    def spy(data, pos, *rest):
        end = real(data, pos, *rest)
        if end:
            spans.append((pos, end))
        return end

    monkeypatch.setattr(torch_records, "named_record", spy)
    taken = 0
    for pt in sorted((out / "checkpoint" / "global_step2").glob("*.pt")):
        with zipfile.ZipFile(pt) as archive:
            data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
        spans.clear()
        assert pickle_scan.walk(data, fast=True) == pickle_scan.walk(data, fast=False), pt.name
        names = [pos + 5 + len(arg) for op, arg, pos in pickletools.genops(data) if op.name == "BINUNICODE"]
        taken += sum(any(start <= end < stop for start, stop in spans) for end in names)
    # param_shapes' 28 sizes but the first (its class comes by GLOBAL); the state dict's entries
    # come before memo index 256 here (BINPUT), which the lanes leave to the walk.
    assert taken >= 20


# --------------------------------------------------------------------------- numpy


@pytest.fixture(scope="module")
def matrix_point(ds):
    save_dir = ds.path("s2-bf16-ws2")
    return save_dir, torch.load(save_dir / "live_fp32.pt", weights_only=True)


def _reconstruct(save_dir: Path, out: Path, *options: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "ckptspec", "reconstruct", "-q", str(save_dir), str(out), *options],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parametrize("dtype,shards", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_load_numpy_gives_the_live_masters(matrix_point, tmp_path, dtype, shards):
    save_dir, live = matrix_point
    out = _reconstruct(save_dir, tmp_path / "out", "--dtype", dtype, *(["--max-shard-size", "2K"] if shards else []))
    assert (out / "model.safetensors.index.json").exists() == shards

    arrays, metadata = _example_module("examples/load_numpy.py").load_arrays(out)
    assert arrays["head.weight"] is arrays["emb.weight"]  # the alias, restored as its owner
    assert arrays["step_count"].dtype == np.int64
    for name, master in live.items():  # trainable parameters, aliases included
        want = master if dtype == "fp32" else master.to(torch.bfloat16).float()  # bf16: rounded, then widened
        assert arrays[name].dtype == np.float32 and _bits(arrays[name]) == _bits(want.numpy()), name

    shown = subprocess.run(
        [sys.executable, str(ROOT / "examples/load_numpy.py"), str(out)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    saved_as = "float32" if dtype == "fp32" else "bfloat16 (numpy has no bfloat16: widened exactly to float32)"
    assert lines[0] == f"{out}: 10 arrays from ZeRO-2 global_step2, saved as {saved_as}"
    assert "  head.weight: float32 [50, 16] (alias of emb.weight)" in lines

"""The main job on an embedded default, end to end, with real DeepSpeed.

1. train a tiny model for two steps with DeepSpeed ZeRO-2 (bf16, 2 ranks, tied
   embedding, a frozen layer, a buffer) and save a checkpoint;
2. describe it: ``ckptspec generate`` (metadata only, no pickle execution);
3. validate the manifest;
4. check the checkpoint's files against the manifest;
5. corrupt copies and show the refusals: a tampered manifest, a transposed shape
   (which DeepSpeed's zero_to_fp32 accepts silently), a truncated shard, a shard that
   would run code on load;
6. reconstruct the full weights (safetensors, no DeepSpeed needed) and refuse to
   reconstruct the corrupt copy.

Run: ``./scripts/demo.sh [--out DIR]`` (default: a fresh temporary directory).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the real-DeepSpeed harness lives with the tests

from _harness.launch import run_tasks
from _harness.scenarios import MATRIX_SPECS


def run(*args: str, expect: int) -> subprocess.CompletedProcess:
    """Run a ckptspec command, echo it like a console session, check its exit code."""
    print(f"\n$ ckptspec {' '.join(shlex.quote(a) for a in args)}")
    result = subprocess.run([sys.executable, "-m", "ckptspec", *args], capture_output=True, text=True)
    out = (result.stdout + result.stderr).rstrip()
    lines = out.splitlines()
    print("\n".join(lines[:12] + ([f"... ({len(lines) - 12} more lines)"] if len(lines) > 12 else [])))
    print(f"[exit {result.returncode}]")
    if result.returncode != expect:
        sys.exit(f"demo failed: expected exit {expect}, got {result.returncode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="ckptspec-demo-"))
    work.mkdir(parents=True, exist_ok=True)

    print("== 1. a real DeepSpeed ZeRO-2 checkpoint (bf16, 2 ranks, tied + frozen + buffer)")
    spec, world_size = MATRIX_SPECS["s2-bf16-ws2"]
    save_dir = work / "deepspeed"
    print(f"  training and saving with {world_size} ranks (torchrun, about 30 s) ...")
    run_tasks([{"kind": "train", "args": spec, "out": str(save_dir)}], world_size, work)
    tag = (save_dir / "latest").read_text().strip()
    for path in sorted((save_dir / tag).iterdir()):
        print(f"  {tag}/{path.name}  {path.stat().st_size} bytes")

    print("\n== 2. describe it (reads metadata only; never executes pickled code)")
    manifest = work / "manifest.json"
    run("generate", str(save_dir), "-o", str(manifest), "--hash", expect=0)
    doc = json.loads(manifest.read_text())
    layout = doc["layout"]
    print(
        f"  stage {layout['zero_stage']}, world size {layout['world_size']}, {layout['model_dtype']} model, "
        f"{layout['master_dtype']} masters; {sum(len(g['params']) for g in doc['groups'])} trainable, "
        f"{len(doc['frozen'])} frozen, {len(doc['aliases'])} alias, {len(doc['buffers'])} buffer; "
        f"{len(doc['files'])} files"
    )

    print("\n== 3. validate the manifest")
    run("validate", str(manifest), expect=0)

    print("\n== 4. check the files against the manifest (sizes, hashes, headers, layout)")
    run("validate", str(manifest), "--checkpoint", str(save_dir), expect=0)

    print("\n== 5. corrupted copies are refused")
    tampered = work / "tampered.json"
    bad = json.loads(manifest.read_text())
    first = bad["groups"][0]["params"][0]
    first["shape"] = first["shape"][::-1] + [2]  # a shape that no longer matches its numel
    bad["aliases"][0]["owner"] = "no.such.weight"
    tampered.write_text(json.dumps(bad, indent=2))
    run("validate", str(tampered), expect=1)

    import torch

    transposed = work / "transposed"
    shutil.copytree(save_dir, transposed)
    model_file = transposed / tag / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=False)
    shapes = state["param_shapes"][0]
    shapes["l2.weight"] = torch.Size(reversed(shapes["l2.weight"]))  # zero_to_fp32 returns it silently
    torch.save(state, model_file)
    run("validate", str(transposed), expect=1)

    truncated = work / "truncated"
    shutil.copytree(save_dir, truncated)
    victim = sorted((truncated / tag).glob("*optim_states.pt"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    run("validate", str(manifest), "--checkpoint", str(truncated), expect=1)

    evil = work / "evil"
    shutil.copytree(save_dir, evil)
    marker = work / "PWNED"
    victim = sorted((evil / tag).glob("*optim_states.pt"))[0]
    state = torch.load(victim, weights_only=False)
    state["client_state"] = _Payload(str(marker))
    torch.save(state, victim)
    run("validate", str(evil), expect=1)
    print(f"  payload executed: {marker.exists()}")
    if marker.exists():
        sys.exit("demo failed: the payload ran")

    print("\n== 6. reconstruct the full weights (validated first; no DeepSpeed, no pickle execution)")
    weights = work / "weights"
    run("reconstruct", str(save_dir), str(weights), "--quiet", expect=0)
    from safetensors.numpy import load_file

    tensors = load_file(weights / "model.safetensors")
    print(
        f"  {weights / 'model.safetensors'}: {len(tensors)} tensors, {sum(t.size for t in tensors.values())} elements"
    )
    refused = work / "weights-from-truncated"
    run("reconstruct", str(truncated), str(refused), "--quiet", expect=1)
    print(
        "  written from the corrupt copy: "
        f"{sorted(p.name for p in refused.glob('*')) if refused.exists() else 'nothing'}"
    )
    print(f"\nall done; files are in {work}")


class _Payload:
    """Pickles to ``open(marker, 'w')``: what a malicious checkpoint would carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


if __name__ == "__main__":
    main()

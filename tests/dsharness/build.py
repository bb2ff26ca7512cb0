"""Build (and cache) real DeepSpeed checkpoints by running train.py under torchrun.

    from dsharness.build import build_checkpoint, run_zero_to_fp32
    save_dir = build_checkpoint({"stage": 2, "dtype": "fp16"}, world_size=2, root=cache_root)
    ref = run_zero_to_fp32(save_dir)     # DeepSpeed's own reconstruction (ground truth)

A cache entry is root/<key>/ where key hashes (normalized spec, world size, DeepSpeed version,
train.py source). It only appears once complete (built in a temp dir, then renamed), and a
per-key file lock stops parallel workers from building the same entry twice.
"""
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .train import normalize_spec

DEEPSPEED_VERSION = "0.19.8"
TRAIN_SCRIPT = Path(__file__).with_name("train.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # the first run on a machine JIT-builds DeepSpeed's shm comm op


class HarnessError(RuntimeError):
    pass


def _check_version():
    import deepspeed
    assert deepspeed.__version__ == DEEPSPEED_VERSION, (
        f"harness is pinned to deepspeed {DEEPSPEED_VERSION}, found {deepspeed.__version__}")


def cache_key(spec: dict, world_size: int) -> str:
    blob = json.dumps({
        "spec": normalize_spec(spec),
        "world_size": world_size,
        "deepspeed": DEEPSPEED_VERSION,
        "train_py": hashlib.sha256(TRAIN_SCRIPT.read_bytes()).hexdigest(),
        # A hook writes ckptspec output into the entry: rebuild when ckptspec changes.
        "hook_sources": _hook_sources_digest() if normalize_spec(spec)["hook"] else None,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _hook_sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*(REPO_ROOT / "ckptspec").glob("*.py"), *(REPO_ROOT / "tests").glob("ds_*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _free_port() -> int:
    # Racy (the port is released before torchrun binds it), hence the retry in _run.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(spec: dict, world_size: int, out: Path) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    # Hooks named in the spec may live in ckptspec or in tests/.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
               str(TRAIN_SCRIPT), "--spec", json.dumps(spec), "--out", str(out)]
        # Own session, so a timeout can kill torchrun together with its worker processes.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO_ROOT, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise HarnessError(f"DeepSpeed run timed out after {TIMEOUT_S}s for spec={spec}:\n{log[-20000:]}")
        if proc.returncode == 0:
            return log
        if "address already in use" not in log.lower() or attempt == 2:
            raise HarnessError(f"DeepSpeed run failed (exit {proc.returncode}) for spec={spec} "
                               f"world_size={world_size}:\n{log[-20000:]}")
        shutil.rmtree(out, ignore_errors=True)


def build_checkpoint(spec: dict, world_size: int, root: Path) -> Path:
    """Return a save dir (contains `latest`, the tag dir, live_fp32.pt, harness.json, train.log)."""
    _check_version()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(spec, world_size)
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "harness.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            t0 = time.monotonic()
            log = _run(spec, world_size, tmp / "ckpt")
            (tmp / "ckpt" / "train.log").write_text(log)
            (tmp / "ckpt" / "build_seconds").write_text(f"{time.monotonic() - t0:.1f}")
            os.rename(tmp / "ckpt", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def run_zero_to_fp32(save_dir) -> dict:
    """DeepSpeed's own zero_to_fp32 reconstruction, in-process."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _check_version()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(save_dir))

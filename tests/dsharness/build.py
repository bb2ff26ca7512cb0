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
        "hook_sources": _hook_sources_digest() if _runs_ckptspec(spec) else None,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _runs_ckptspec(spec: dict) -> bool:
    full = normalize_spec(spec)
    return bool(full["hook"]) or full["save_with"] == "ckptspec"


def _hook_sources_digest() -> str:
    digest = hashlib.sha256()
    # Only what the hooks and ckptspec.deepspeed.save_checkpoint run inside the job.
    hooked = ["deepspeed", "layout", "models", "rules", "findings", "torch_dtypes", "embed", "encoding", "hashing"]
    sources = [REPO_ROOT / "ckptspec" / f"{name}.py" for name in hooked]
    for path in sorted([*(p for p in sources if p.exists()), *(REPO_ROOT / "tests").glob("ds_*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _free_port() -> int:
    # Racy (the port is released before torchrun binds it), hence the retry in _run.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_extensions_dir(python: str = sys.executable) -> str:
    """Where DeepSpeed JIT-builds its shm comm op for the environment of ``python``.

    One directory per environment (DeepSpeed version and interpreter prefix): two
    versions sharing one break each other's builds, and two virtualenvs of the same
    version compile with different include paths, so they would rebuild it in turns.
    Every DeepSpeed job the tests start (harness, resume, examples) uses this.
    """
    version = DEEPSPEED_VERSION if python == sys.executable else OLD_DEEPSPEED_VERSION
    prefix = hashlib.sha256(os.path.abspath(python).encode()).hexdigest()[:8]  # not resolved: a venv links its python
    return str(Path.home() / ".cache" / "torch_extensions" / f"ckptspec-deepspeed-{version}-{prefix}")


def run_torchrun(script: Path, args: list[str], world_size: int, out: Path, python: str = sys.executable,
                 what: str = "DeepSpeed run") -> str:
    """Run ``script`` under torchrun on the CPU; returns its log, raises ``HarnessError``.

    Every DeepSpeed job of the tests (train.py, resume.py) starts here: same environment,
    same timeout, and a retry when torchrun lost the race for its free port.
    """
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir(python)
    # Hooks named in a spec may live in ckptspec or in tests/.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for attempt in range(3):
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(script), *args]
        # Own session, so a timeout can kill torchrun together with its worker processes.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO_ROOT, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise HarnessError(f"{what} timed out after {TIMEOUT_S}s ({' '.join(args)}):\n{log[-20000:]}")
        if proc.returncode == 0:
            return log
        if "address already in use" not in log.lower() or attempt == 2:
            raise HarnessError(f"{what} failed (exit {proc.returncode}, world_size={world_size}, "
                               f"{' '.join(args)}):\n{log[-20000:]}")
        shutil.rmtree(out, ignore_errors=True)


def _run(spec: dict, world_size: int, out: Path, python: str = sys.executable) -> str:
    return run_torchrun(TRAIN_SCRIPT, ["--spec", json.dumps(spec), "--out", str(out)], world_size, out, python)


def build_checkpoint(spec: dict, world_size: int, root: Path, deepspeed_version: str = DEEPSPEED_VERSION) -> Path:
    """Return a save dir (contains `latest`, the tag dir, live_fp32.pt, harness.json, train.log).

    ``deepspeed_version`` OLD_DEEPSPEED_VERSION writes the checkpoint with that older DeepSpeed
    (a separate virtualenv, made on first use by ``old_deepspeed_python``).
    """
    _check_version()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    python = sys.executable if deepspeed_version == DEEPSPEED_VERSION else old_deepspeed_python(root)
    key = cache_key(spec, world_size) + ("" if deepspeed_version == DEEPSPEED_VERSION else f"-ds{deepspeed_version}")
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "harness.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            t0 = time.monotonic()
            log = _run(spec, world_size, tmp / "ckpt", python)
            (tmp / "ckpt" / "train.log").write_text(log)
            (tmp / "ckpt" / "build_seconds").write_text(f"{time.monotonic() - t0:.1f}")
            os.rename(tmp / "ckpt", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


OLD_DEEPSPEED_VERSION = "0.15.4"  # before param_alignment_paddings; stage 3 on CPU needs numactl
OLD_VENV = REPO_ROOT / ".venv-ds015"


def old_deepspeed_python(root: Path) -> str:
    """A virtualenv with DeepSpeed OLD_DEEPSPEED_VERSION (and ckptspec, for the hooks), made once."""
    python = OLD_VENV / "bin" / "python"
    with open(Path(root) / "old-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = OLD_VENV / ".ready"
        if not stamp.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(OLD_VENV)], check=True)
            # torch first: it is the CPU wheel on this machine's disk (see README).
            for args in (["torch==2.13.0"], [f"deepspeed=={OLD_DEEPSPEED_VERSION}", "-e", str(REPO_ROOT)]):
                done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
                if done.returncode != 0:
                    raise HarnessError(f"installing {args} for the old-DeepSpeed venv failed:\n{done.stderr[-5000:]}")
            stamp.touch()
    return str(python)


def run_zero_to_fp32(save_dir) -> dict:
    """DeepSpeed's own zero_to_fp32 reconstruction, in-process."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _check_version()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(save_dir))

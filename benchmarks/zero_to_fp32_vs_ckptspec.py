"""What DeepSpeed's zero_to_fp32 does with each corruption of the fault suite, next to ckptspec.

For every fault of tests/faults.py: copy the clean checkpoint, corrupt it, then

* run DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (the code behind
  ``zero_to_fp32.py``) in a subprocess, and classify what happened by measurement:
  - **code execution**: the malicious pickle's marker file exists afterwards;
  - **error**: an exception raised by one of zero_to_fp32.py's own explicit checks
    (the innermost frame is a ``raise`` statement in zero_to_fp32.py);
  - **cryptic error**: any other exception (raised deeper, in torch or by an index/key lookup);
  - **silent wrong output**: no exception, but the state dict differs from the one
    zero_to_fp32 returns for the clean checkpoint (keys, shapes, dtypes or values);
  - **accepted (output unchanged)**: no exception and the same state dict;
* run ``ckptspec validate`` (exit code and codes reported).

The markdown table is written into docs/validation.md between the marker comments.

    DS_ACCELERATOR=cpu CKPTSPEC_DS_CACHE=/tmp/dscache \
        python benchmarks/zero_to_fp32_vs_ckptspec.py [--no-write] [--timing-only]

It also times validation of the ~1.4 GB checkpoints of benchmarks/make_big_checkpoint.py when they
have been built (it never builds them) and writes that table between its own markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _harness import tasks
from _harness.faults import FAULTS, FaultEnv, base_dir

DOC = ROOT / "docs" / "validation.md"
BEGIN, END = "<!-- zero_to_fp32-vs-ckptspec:begin -->", "<!-- zero_to_fp32-vs-ckptspec:end -->"

DRIVER = r"""
import json, os, sys, traceback
os.environ.setdefault("DS_ACCELERATOR", "cpu")
save_dir, out, result = sys.argv[1:4]
status = {}
try:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    import torch
    torch.save({k: v.detach().clone() for k, v in state.items()}, out)
    status["outcome"] = "ok"
except BaseException as exc:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    status.update(outcome="exception", type=type(exc).__name__, message=str(exc), file=os.path.basename(frame.filename),
                  line=frame.lineno, source=(frame.line or "").strip())
with open(result, "w") as fh:
    json.dump(status, fh)
"""


def run_zero_to_fp32(save_dir: Path, work: Path) -> dict:
    out, result = work / "z2f.pt", work / "z2f.json"
    for p in (out, result):
        p.unlink(missing_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(save_dir), str(out), str(result)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if not result.exists():  # the interpreter itself died
        return {
            "outcome": "exception",
            "type": f"exit {proc.returncode}",
            "message": proc.stderr[-300:],
            "file": "",
            "source": "",
        }
    status = json.loads(result.read_text())
    status["output"] = out if status["outcome"] == "ok" else None
    return status


def compare(reference: Path, output: Path) -> str | None:
    """None when equal, else what differs (first difference)."""
    import torch

    ref = torch.load(reference, weights_only=True)
    got = torch.load(output, weights_only=True)
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    if missing:
        return f"{', '.join(missing)} missing"
    if extra:
        return f"extra {', '.join(extra)}"
    for name in ref:
        a, b = ref[name], got[name]
        if a.shape != b.shape:
            return f"{name} has shape {tuple(b.shape)}, not {tuple(a.shape)}"
        if a.dtype != b.dtype:
            return f"{name} is {b.dtype}, not {a.dtype}"
        if not torch.equal(a, b):
            delta = (a.float() - b.float()).abs().max().item()
            return f"{name} has wrong values (max |Δ| {delta:.3g})"
    return None


def cell(text: str) -> str:
    """Safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def classify(status: dict, reference: Path, marker: Path, save_dir: Path) -> tuple[str, str]:
    if marker.exists():
        return "code execution", "the pickle ran `Path.touch` while loading"
    if status["outcome"] == "exception":
        message = " ".join(status["message"].replace(str(save_dir), "CKPT").split()).replace("`", "'")
        if len(message) > 110:
            message = message[:107] + "..."
        text = f"`{status['type']}: {message}`" if message else f"`{status['type']}`"
        explicit = status["file"] == "zero_to_fp32.py" and status["source"].startswith("raise")
        return ("error" if explicit else "cryptic error"), text
    diff = compare(reference, status["output"])
    return ("silent wrong output", diff) if diff else ("accepted (output unchanged)", "")


def run_ckptspec(args: list[str]) -> tuple[int, list[tuple[str, str | None]], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptspec", "validate", *args, "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    report = json.loads(proc.stdout)
    found = [(f["code"], f.get("file")) for f in report["findings"]]
    if "error" in report:
        found.append((report["error"]["code"], None))
    return proc.returncode, found, proc.stderr


def ckptspec_cell(fault, exit_code: int, found: list[tuple[str, str | None]]) -> str:
    from ckptspec.deepspeed.check.domain import CHECKS

    names = {c.code: c.name for c in CHECKS} | {"CK201": "no-tag", "CK203": "no-model-states", "CK105": "alias-shape"}
    codes = list(dict.fromkeys(code for code, _ in found))
    codes.sort(key=lambda c: c != fault.code)  # the code the suite asserts first
    shown = ", ".join(f"`{c}` {names.get(c, '')}".strip() for c in codes)
    return f"exit {exit_code}: {shown}" if codes else f"exit {exit_code}"


TIMING_BEGIN, TIMING_END = "<!-- validation-timing:begin -->", "<!-- validation-timing:end -->"


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


def _wall(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptspec", *args], capture_output=True, cwd=ROOT, check=False)
    return time.perf_counter() - t0


def timing(work: Path) -> str | None:
    """Validation of the ~1.4 GB checkpoints of benchmarks/make_big_checkpoint.py (never built here)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_big_checkpoint import checkpoint_dir

    from ckptspec.deepspeed.check.zero import validate_checkpoint
    from ckptspec.deepspeed.describe import describe
    from ckptspec.format.codec import write_manifest
    from ckptspec.format.documents import load_manifest

    rows = []
    for stage in (2, 3):
        save_dir = checkpoint_dir(stage)
        if not (save_dir / "latest").exists():
            print(f"timing: {save_dir} not built (benchmarks/make_big_checkpoint.py); skipped")
            continue
        manifest, findings = validate_checkpoint(save_dir)  # warm the page cache and imports
        assert findings == [], findings
        size = sum(f.size for f in manifest.files)
        runs = []
        for _ in range(5):
            r0, t0 = _rchar(), time.perf_counter()
            validate_checkpoint(save_dir)
            runs.append((time.perf_counter() - t0, _rchar() - r0))
        seconds, read = sorted(runs)[len(runs) // 2]
        cli = sorted(_wall(["validate", str(save_dir)]) for _ in range(3))[1]
        startup = sorted(_wall(["--version"]) for _ in range(3))[1]
        hashed = work / f"big{stage}.json"
        write_manifest(describe(save_dir, hash_algorithm="sha256"), str(hashed))
        recorded = load_manifest(hashed)
        t0 = time.perf_counter()
        _, findings = validate_checkpoint(save_dir, recorded)
        with_hash = time.perf_counter() - t0
        assert findings == [], findings
        rows.append(
            f"| ZeRO-{stage}, 2 ranks, bf16 | {size / 1e9:.2f} GB | {seconds * 1000:.0f} ms, {read / 1024:.0f} KiB "
            "read "
            f"| {cli:.2f} s (interpreter start-up alone: {startup:.2f} s) | {with_hash:.2f} s "
            f"({size / with_hash / 1e6:.0f} MB/s) |"
        )
        print(rows[-1], flush=True)
    if not rows:
        return None
    return "\n".join(
        [
            TIMING_BEGIN,
            "| checkpoint | size | `validate_checkpoint`, no hashes (median of 5) | `ckptspec validate DIR` wall "
            "time | "
            "with SHA-256 verification (throughput) |",
            "|---|---|---|---|---|",
            *rows,
            TIMING_END,
        ]
    )


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{DOC} lacks the marker comments {begin} ... {end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-write", action="store_true", help="print the table instead of updating docs/validation.md"
    )
    parser.add_argument(
        "--timing-only", action="store_true", help="only time validation of the ~1.4 GB benchmark checkpoints"
    )
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    if args.timing_only:
        with tempfile.TemporaryDirectory() as tmp:
            block = timing(Path(tmp))
        if block and not args.no_write:
            DOC.write_text(replace_block(DOC.read_text("utf-8"), TIMING_BEGIN, TIMING_END, block), "utf-8")
        return 0

    import deepspeed
    import torch

    bases: dict[str, Path] = {}
    for name in sorted({f.base for f in FAULTS} | {f.donor for f in FAULTS if f.donor}):
        # the test suite's cache (tests/_harness/cache.py), or a checkpoint committed to the repository
        bases[name] = base_dir(name, lambda: tasks)

    rows = []
    tally: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="z2f-vs-ckptspec-") as tmp:
        work = Path(tmp)
        references = {}
        for name in sorted({f.base for f in FAULTS}):
            status = run_zero_to_fp32(bases[name], work)
            if status["outcome"] != "ok":
                raise SystemExit(f"zero_to_fp32 fails on the clean {name}: {status}")
            references[name] = work / f"ref-{name}.pt"
            shutil.move(status["output"], references[name])
        for i, fault in enumerate(FAULTS, 1):
            case = work / fault.name
            save_dir = case / "ckpt"
            shutil.copytree(bases[fault.base], save_dir)
            cli_args = [str(save_dir)]
            if fault.hashed_manifest:
                manifest = case / "manifest.json"
                subprocess.run(
                    [sys.executable, "-m", "ckptspec", "generate", str(save_dir), "--hash", "-o", str(manifest)],
                    check=True,
                    cwd=ROOT,
                )
                if fault.digests_only:  # only the tensor digests may tell (tests/_harness/faults.py)
                    doc = json.loads(manifest.read_text())
                    for f in doc["files"]:
                        del f["hash"]
                    manifest.write_text(json.dumps(doc))
                cli_args = [str(manifest), "--checkpoint", str(save_dir)]
            marker = case / "pwned"
            fault.mutate(save_dir, FaultEnv(bases.get(fault.donor) if fault.donor else None, marker))
            t0 = time.perf_counter()
            exit_code, found, stderr = run_ckptspec(cli_args)
            elapsed = time.perf_counter() - t0
            assert not marker.exists(), "ckptspec ran pickled code"
            assert "Traceback" not in stderr, stderr
            status = run_zero_to_fp32(save_dir, case)
            kind, detail = classify(status, references[fault.base], marker, save_dir)
            tally[kind] = tally.get(kind, 0) + 1
            z2f = f"**{kind}**" + (f": {detail}" if detail else "")
            rows.append(
                f"| {i} | {cell(fault.description)} | {cell(z2f)} | {cell(ckptspec_cell(fault, exit_code, found))} |"
            )
            print(
                f"{fault.name:34s} zero_to_fp32: {kind:28s} ckptspec: exit {exit_code} {sorted({c for c, _ in found})} "
                f"({elapsed:.2f}s)",
                flush=True,
            )

    summary = ", ".join(f"{n} {k}" for k, n in sorted(tally.items(), key=lambda kv: -kv[1]))
    table = "\n".join(
        [
            BEGIN,
            f"Measured by `benchmarks/zero_to_fp32_vs_ckptspec.py` with DeepSpeed {deepspeed.__version__} and torch "
            f"{torch.__version__} on checkpoints built by `tests/_harness` ({len(FAULTS)} corruptions; "
            f"zero_to_fp32: {summary}).",
            "",
            "| # | corruption | DeepSpeed `zero_to_fp32` | `ckptspec validate` |",
            "|---|---|---|---|",
            *rows,
            END,
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        timing_block = timing(Path(tmp))
    if args.no_write:
        print(table)
        print(timing_block or "")
        return 0
    text = replace_block(DOC.read_text("utf-8"), BEGIN, END, table)
    if timing_block:
        text = replace_block(text, TIMING_BEGIN, TIMING_END, timing_block)
    DOC.write_text(text, "utf-8")
    print(f"updated {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

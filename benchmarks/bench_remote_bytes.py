"""What each command fetches of a real ~100M-parameter checkpoint that carries its manifest, over HTTP.

    .venv/bin/python benchmarks/bench_remote_bytes.py [--checkpoint SAVE_DIR]

Builds (once, cached; make_big_checkpoint.py) the 2-rank bf16 ZeRO-2 checkpoint (~1.4 GB), makes
two copies of it (hard links; ``ckptspec embed`` writes the new model states and the sidecar beside
them): one embedded with hashes (file hashes and tensor digests, ``ckptspec embed``) and one with
``--no-hash``, serves them with a real nginx on 127.0.0.1 (tests/_harness/servers.py) and runs each
command once, as its own process (benchmarks/child.py). For each: the bytes and requests ckptspec
counts, the bytes of the files nginx's access log says it sent (index pages not included), the
bytes of any file sent more than once (the byte ranges of its answers overlapping), and the share of
the checkpoint's bytes (its tag directory's files). Peak RSS shows that memory stays flat.

Which ckptspec runs is the one the interpreter imports (set PYTHONPATH to measure another source
tree, e.g. an older commit's ``git archive``); the table names it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _harness.servers import start_nginx
from child import load_line, run_child
from make_big_checkpoint import build

CLI = [sys.executable, "-m", "ckptspec"]


def fetched_of(output: str) -> tuple[int, int] | None:
    """(bytes, requests) from ckptspec's own line: ``fetched N bytes in M requests``."""
    for line in output.splitlines():
        if "fetched " in line:
            words = line.split("fetched ", 1)[1].split()
            return int(words[0].replace(",", "")), int(words[3].replace(",", ""))
    return None


def sent_files(log: list[tuple[str, str, int, int, str]]) -> tuple[int, int, int]:
    """(bytes of files sent, bytes sent more than once, requests) from nginx's log lines."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    requests = 0
    for method, uri, status, sent, rng in log:
        requests += 1
        if method != "GET" or uri.endswith("/") or status not in (200, 206):
            continue
        start = int(rng.removeprefix("bytes=").split("-")[0]) if status == 206 else 0
        ranges.setdefault(uri, []).append((start, start + sent))
    total = twice = 0
    for spans in ranges.values():
        reach = 0
        for start, end in sorted(spans):
            total += end - start
            twice += max(0, min(end, reach) - start)
            reach = max(reach, end)
    return total, twice, requests


def embedded_copy(save_dir: Path, dest: Path, *args: str) -> Path:
    """A copy of ``save_dir`` (hard links) with ``ckptspec embed`` run on it."""
    shutil.copytree(save_dir, dest, copy_function=os.link, ignore=shutil.ignore_patterns("*.json", "*.log"))
    subprocess.run([*CLI, "embed", str(dest), *args], check=True, capture_output=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a save directory to read instead of the 100M one")
    args = parser.parse_args()
    start_load = os.getloadavg()
    save_dir = args.checkpoint or build(2)
    which = subprocess.run(
        [sys.executable, "-c", "import ckptspec; print(ckptspec.__file__)"], capture_output=True, text=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="ckptspec-bench-remote-bytes-", dir=save_dir.parent))
    nginx = start_nginx(work / "nginx")
    rows = []
    try:
        copies = {
            "sidecar with hashes": embedded_copy(save_dir, work / "hashed"),
            "sidecar without hashes": embedded_copy(save_dir, work / "unhashed", "--no-hash"),
        }
        runs = [
            ("sidecar with hashes", "validate --no-hash"),
            ("sidecar with hashes", "validate"),
            ("sidecar with hashes", "reconstruct"),
            ("sidecar without hashes", "reconstruct"),
        ]
        for kind, command in runs:
            local = copies[kind]
            if not (nginx.root / local.name).is_symlink():
                (nginx.root / local.name).symlink_to(local)
            url = nginx.url(local.name)
            tag = (local / "latest").read_text().strip()
            total = sum(p.stat().st_size for p in (local / tag).iterdir() if p.is_file())
            out = work / "out"
            cmd = CLI + (
                ["reconstruct", url, str(out)] if command == "reconstruct" else ["validate", url, *command.split()[1:]]
            )
            mark = nginx.mark()
            result = run_child(cmd, dict(os.environ))
            result["load"] = os.getloadavg()[0]
            shutil.rmtree(out, ignore_errors=True)
            got = fetched_of(result["out"])
            sent, twice, requests = sent_files(nginx.since(mark))
            rows.append((kind, command, total, result, got, sent, twice, requests))
            print(f"{command} ({kind}): {result['wall']:.1f} s, {sent:,} bytes sent", file=sys.stderr)
    finally:
        nginx.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"checkpoint: {save_dir.name} with a sidecar (ckptspec embed); ckptspec from {which}")
    print(load_line(start_load) + "; each command run once\n")
    print(
        "| checkpoint | command | files' bytes | fetched (ckptspec) | requests (ckptspec) | file bytes sent (nginx) "
        "| sent twice | requests (nginx) | x the files | wall s | peak RSS MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, command, total, result, got, sent, twice, requests in rows:
        fetched, asked = (f"{n:,}" for n in got) if got is not None else ("", "")
        print(
            f"| {kind} | `{command}` | {total:,} | {fetched} | {asked} | {sent:,} | {twice:,} | {requests:,} "
            f"| {sent / total:.4f} | {result['wall']:.1f} | {result['rss_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()

"""What reading a real ~100M-parameter ZeRO-2 checkpoint over HTTP (nginx) and S3 (moto) costs,
beside the same commands on the local directory.

    .venv/bin/python benchmarks/bench_remote.py [--s3]

Builds (once, cached; make_big_checkpoint.py) the 2-rank bf16 ZeRO-2 checkpoint (~1.4 GB),
serves it with a real nginx on 127.0.0.1 (tests/_harness/servers.py; the Debian package
scripts/env.sh installs) and, with ``--s3``, uploads it with s3fs to moto's S3 server. Each
command runs as its own process (benchmarks/child.py): wall time, peak RSS, and the bytes
fetched, as ckptspec counts them and as nginx's access log says it sent them (every request,
listings and HEADs included). The reconstructions are compared byte for byte with the local one.
The machine may be shared: the load average is printed with the table; bytes and peak RSS
ratios are what the numbers are for.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _harness.servers import start_nginx, start_s3
from child import load_line, run_child
from make_big_checkpoint import build

CLI = [sys.executable, "-m", "ckptspec"]
# The local command with a backend imported first: what importing it costs a reconstruction, exactly.
IMPORTING = "import sys, runpy, {module}; sys.argv[0] = 'ckptspec'; runpy.run_module('ckptspec', run_name='__main__')"
BACKENDS = {"HTTP (nginx)": "fsspec.implementations.http", "S3 (moto)": "s3fs"}


def digest(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.iterdir()):
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):  # small reads: this process's peak RSS stays low
                h.update(chunk)
        out[path.name] = h.hexdigest()
    return out


def fetched_of(output: str) -> int | None:
    for line in output.splitlines():
        if "fetched " in line:
            return int(line.split("fetched ", 1)[1].split(" bytes", 1)[0].replace(",", ""))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s3", action="store_true", help="also upload to moto's S3 server and read it there")
    parser.add_argument("--checkpoint", type=Path, help="a save directory to read instead of the 100M one")
    args = parser.parse_args()
    start_load = os.getloadavg()
    save_dir = args.checkpoint or build(2)
    tag = (save_dir / "latest").read_text().strip()
    total = sum(p.stat().st_size for p in (save_dir / tag).iterdir() if p.is_file())
    work = Path(tempfile.mkdtemp(prefix="ckptspec-bench-remote-"))
    nginx = start_nginx(work / "nginx")
    s3 = None
    rows = []
    try:
        (nginx.root / "big").symlink_to(save_dir.resolve())
        url = nginx.url("big")
        env = dict(os.environ)
        places = [("local", str(save_dir), None), ("HTTP (nginx)", url, nginx)]
        if args.s3:
            s3 = start_s3(work / "moto")
            env.update(s3.env)
            # Uploaded by a child process: a child's ru_maxrss starts at its parent's peak (child.py),
            # and s3fs's upload would raise this process's peak to the size of a file.
            code = (
                "import sys; sys.path.insert(0, sys.argv[1]); from _harness.servers import S3Server, upload; "
                "print(upload(S3Server(int(sys.argv[2]), None, None), sys.argv[3]))"
            )
            done = run_child([sys.executable, "-c", code, str(HERE.parent / "tests"), str(s3.port), str(save_dir)], env)
            places.append(("S3 (moto)", done["out"].strip().splitlines()[-1], None))
        outputs = {}
        for where in [w for w, _, _ in places if w in BACKENDS]:
            out = work / "out-import"
            code = IMPORTING.format(module=BACKENDS[where])
            result = run_child([sys.executable, "-c", code, "reconstruct", str(save_dir), str(out)], env)
            result["load"] = os.getloadavg()[0]
            shutil.rmtree(out)
            rows.append(("reconstruct (imports the backend first)", f"local, {where}", result, None, None))
        for where, target, server in places:
            for command in ("validate", "reconstruct"):
                out = work / f"out-{len(outputs)}"
                cmd = CLI + (
                    ["validate", target, "--no-hash"] if command == "validate" else ["reconstruct", target, str(out)]
                )
                mark = server.mark() if server else 0
                result = run_child(cmd, env)
                result["load"] = os.getloadavg()[0]
                sent = sum(line[3] for line in server.since(mark)) if server else None
                got = fetched_of(result["out"])
                if command == "reconstruct":
                    outputs[where] = digest(out)
                    shutil.rmtree(out)
                print(
                    f"{command} from {where}: {result['wall']:.1f} s, {result['cpu']:.1f} s CPU, "
                    f"{result['rss_mib']:.1f} MiB",
                    file=sys.stderr,
                )
                rows.append(
                    (f"{command} {'--no-hash' if command == 'validate' else ''}".strip(), where, result, got, sent)
                )
        same = all(d == outputs["local"] for d in outputs.values())
    finally:
        nginx.stop()
        if s3 is not None:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"checkpoint: {save_dir.name}, {total:,} bytes in {tag}/ ({total / 2**30:.2f} GiB)")
    print(load_line(start_load) + "\n")
    print(
        "| command | from | wall s | CPU s | load (1 min) | peak RSS MiB | bytes fetched (ckptspec) "
        "| bytes sent (nginx log) | % of files |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for command, where, result, got, sent in rows:
        shown = sent if sent is not None else got
        pct = f"{100 * shown / total:.4f}" if shown is not None else ""
        print(
            f"| {command} | {where} | {result['wall']:.1f} | {result['cpu']:.1f} | {result.get('load', 0):.1f} "
            f"| {result['rss_mib']:.1f} | "
            f"{'' if got is None else f'{got:,}'} | {'' if sent is None else f'{sent:,}'} | {pct} |"
        )
    print(f"\nreconstructions bit-identical to the local one: {same}")


if __name__ == "__main__":
    main()

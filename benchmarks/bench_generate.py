"""How `ckptspec generate` (and validate, reconstruct) scale with the number of tensors (issue #8).

    .venv/bin/python benchmarks/bench_generate.py                    # N = 10k 25k 50k 100k, ZeRO-2
    .venv/bin/python benchmarks/bench_generate.py --tensors 10000 --tensors 25000 --stage 3 --runs 1
    .venv/bin/python benchmarks/bench_generate.py --profile 100000   # cProfile of one in-process generate

Checkpoints come from make_many_tensors.py (real DeepSpeed, built once and cached). Every
command runs as its own process; a row keeps the fastest of ``--runs`` runs (wall clock,
process start to exit), the CPU seconds of that run, and the largest peak RSS
(``ru_maxrss``) over the runs. This script imports nothing heavy, because a child's
``ru_maxrss`` starts at its parent's peak; the in-process breakdown runs in a child too.

``s/10k`` divides the whole-process time by N/10k; ``marginal s/10k`` is the slope of a
least-squares line through the (N, seconds) points, i.e. the cost of 10k more tensors
with the fixed start-up cost taken out. Linear scaling keeps the marginal value constant
between sizes (the "slope" columns of the second table, from consecutive sizes).

Other scripts use ``rows(sizes)`` (one dict per N) and ``markdown(rows)``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from child import run_child as run_once
from make_many_tensors import SIZES, WORLD_SIZE, BuildTimeout, build, build_info

PY = sys.executable
CLI = [PY, "-m", "ckptspec"]


def best_of(cmd: list[str], runs: int, env: dict | None = None, before=None) -> dict:
    """The fastest run's wall and CPU time, the largest peak RSS over all runs."""
    results = []
    for _ in range(runs):
        if before is not None:
            before()
        results.append(run_once(cmd, env))
    best = min(results, key=lambda r: r["wall"])
    return dict(best, rss_mib=max(r["rss_mib"] for r in results))


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("CKPTSPEC_DEBUG", None)
    return env


# --------------------------------------------------------------------------- in-process breakdown (child)


def breakdown(checkpoint: str, out: str) -> dict:
    """Seconds of each step of `ckptspec generate` in this process, then of validating the
    result (which generate does not do; reported apart). Wall and CPU per step."""
    steps: dict[str, list[float]] = {}

    def step(name: str, t: tuple[float, float]) -> tuple[float, float]:
        now = (time.perf_counter(), time.process_time())
        steps[name] = [round(now[0] - t[0], 3), round(now[1] - t[1], 3)]
        return now

    import gc

    gc.disable()  # as `ckptspec generate` (cli/generate.py)
    from ckptspec._forked import fork_by_default

    fork_by_default()  # as `ckptspec generate` (cli.main): a second CPU walks the pickles
    t = (time.perf_counter(), time.process_time())
    from ckptspec._fs import write_atomic
    from ckptspec.checkpoint.states import StateCache
    from ckptspec.deepspeed.describe.zero import manifest_from_states
    from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir, scan_tag_dir
    from ckptspec.format.codec import dumps

    t = step("import", t)
    tag_dir = resolve_tag_dir(checkpoint)
    shards = scan_tag_dir(tag_dir)
    states = StateCache()
    files = [*shards.model_files.values(), *shards.optim_files.values()]
    states.load_all(files)  # the pickles, scanned side by side (checkpoint/prescan.py)
    for p in files:
        states.members(p)  # the zip directory
    t = step("read data.pkl", t)
    manifest = manifest_from_states(shards, states)
    t = step("build manifest", t)
    doc = manifest.to_dict()
    t = step("to_dict", t)
    data = dumps(doc)
    t = step("encode json", t)
    write_atomic(out, data)
    t = step("write", t)
    from ckptspec.format.validate import validate_document

    t = step("(import validate)", t)
    report = validate_document(doc)
    step("(validate manifest)", t)
    return {
        "steps": steps,
        "valid": report.ok,
        "params": sum(len(g.params) for g in manifest.groups),
        "frozen": len(manifest.frozen),
        "aliases": len(manifest.aliases),
        "bytes": len(data),
    }


def profile(checkpoint: str, top: int = 25) -> None:
    """cProfile of one in-process generate (no validation), top functions by own time."""
    import cProfile
    import pstats

    from ckptspec.deepspeed.describe import describe
    from ckptspec.format.codec import dumps

    prof = cProfile.Profile()
    prof.enable()
    dumps(describe(checkpoint))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


# --------------------------------------------------------------------------- rows


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept s, slope s per tensor) of the least-squares line; slope 0 for one point."""
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def _warm(checkpoint: Path) -> None:
    # Read every file once, so every command reads from the page cache.
    for path in checkpoint.rglob("*.pt"):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass


def rows(
    sizes=SIZES,
    *,
    stage: int = 2,
    runs: int = 3,
    commands=("generate", "validate", "reconstruct"),
    build_timeout: float | None = None,
    log=print,
) -> list[dict]:
    """One dict per N: DeepSpeed's times, then every ckptspec command's best wall s, CPU s and peak MiB.

    ``sizes``: N, or (N, ranks) for a checkpoint saved by another number of ranks than 2 (one rank is
    how 1M tensors fit this machine). Sizes whose checkpoint DeepSpeed cannot build within
    ``build_timeout`` give a row with ``"skipped"`` set."""
    env = _env()
    out: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-bench-gen-"))
    try:
        floor = best_of([PY, "-c", "pass"], runs, env)
        cli_floor = best_of(CLI + ["--version"], runs, env)
        for size in sizes:
            n, ranks = size if isinstance(size, tuple) else (size, WORLD_SIZE)
            kw = {} if build_timeout is None else {"timeout": build_timeout}
            try:
                ckpt = build(n, stage, world_size=ranks, **kw)
            except BuildTimeout as exc:
                out.append({"tensors": n, "stage": stage, "ranks": ranks, "skipped": str(exc)})
                continue
            info = build_info(ckpt)
            _warm(ckpt)
            row: dict = {
                "tensors": n,
                "stage": stage,
                "ranks": ranks,
                "checkpoint": str(ckpt),
                "loadavg": [],
                "floor_s": floor["wall"],
                "cli_floor_s": cli_floor["wall"],
                "cli_floor_mib": cli_floor["rss_mib"],
                "deepspeed_times": info["deepspeed_times"],
                "frozen_tensors": info["frozen_tensors"],
                "tied_aliases": info["tied_aliases"],
                "shard_bytes": sum(p.stat().st_size for p in ckpt.rglob("*.pt")),
            }
            manifest, hashed = scratch / f"m-{n}.json", scratch / f"m-{n}-hash.json"  # per N: never a stale one
            recon = scratch / "recon"

            def hashed_manifest(ckpt=ckpt, hashed=hashed):
                return hashed.exists() or run_once(CLI + ["generate", str(ckpt), "-o", str(hashed), "--hash"])

            def clear_output(recon=recon):
                shutil.rmtree(recon, ignore_errors=True)

            jobs = []
            if "generate" in commands:
                jobs += [
                    ("generate", CLI + ["generate", str(ckpt), "-o", str(manifest)], None),
                    ("generate --hash", CLI + ["generate", str(ckpt), "-o", str(hashed), "--hash"], None),
                ]
            if "validate" in commands:
                # A hashed 1M-tensor manifest (a digest per tensor) is 771 MB of JSON, over validate's
                # default 512 MiB limit (CK902): the larger checkpoints raise it, as its hint says.
                big = ["--max-size", str(4 * 2**30)] if n > 250_000 else []
                jobs += [("validate DIR --no-hash", CLI + ["validate", str(ckpt), "--no-hash"], None)]
                jobs += [
                    (
                        "validate M --checkpoint DIR",
                        CLI + ["validate", str(hashed), "--checkpoint", str(ckpt), *big],
                        hashed_manifest,
                    )
                ]
                jobs += [("validate M", CLI + ["validate", str(hashed), *big], None)]
            if "reconstruct" in commands:
                jobs += [("reconstruct", CLI + ["reconstruct", str(ckpt), str(recon), "--quiet"], clear_output)]
            for name, cmd, before in jobs:
                log(f"  N={n} stage {stage}: {name} ...")
                try:
                    r = best_of(cmd, runs, env, before)
                except RuntimeError as exc:  # one failing command must not lose the whole table
                    log(f"  N={n} stage {stage}: {name} FAILED: {exc}")
                    continue
                row[name] = {"wall": r["wall"], "cpu": r["cpu"], "rss_mib": r["rss_mib"], "load": os.getloadavg()[0]}
                row[name]["cmd"] = " ".join(["ckptspec", *cmd[len(CLI) :]]).replace(str(scratch), "$TMP")
                row["loadavg"].append(os.getloadavg()[0])
            if manifest.exists():
                row["manifest_bytes"] = manifest.stat().st_size
            if "generate" in commands:
                child = run_once([PY, __file__, "--breakdown", str(ckpt), str(scratch / "b.json")], env)
                row["breakdown"] = json.loads(child["out"].strip().splitlines()[-1])
            out.append(row)
            shutil.rmtree(recon, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- tables


def _cmds(rows_: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows_:
        for k, v in r.items():
            if isinstance(v, dict) and "wall" in v and k not in seen:
                seen.append(k)
    return seen


# Issue #19: generate and validate DIR in at most 2 s at 100k tensors, 20 s at 1M, linear between.
_GOAL_COMMANDS = ("generate", "validate DIR --no-hash")


def _goal(cmd: str, row: dict) -> str:
    if cmd not in _GOAL_COMMANDS or row["tensors"] < 100_000:
        return ""
    limit = 2.0 + 18.0 * (row["tensors"] - 100_000) / 900_000
    wall = row[cmd]["wall"]
    return f"<= {limit:g} s: {'met' if wall <= limit else 'NOT met'}"


def _is_cmd(value) -> bool:
    return isinstance(value, dict) and "cmd" in value


def markdown(rows_: list[dict]) -> str:
    """Markdown tables: one row per (N, command), a linearity summary, the generate breakdown."""
    done = [r for r in rows_ if "skipped" not in r]
    lines = [
        "| N tensors | stage | ranks | command | wall s | CPU s | goal | s/10k | marginal s/10k | peak MiB "
        "| manifest KiB | load (1 min) |",
        "|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for cmd in _cmds(done):
        by_layout: dict[tuple[int, int], list[dict]] = {}
        for r in done:
            if cmd in r:
                by_layout.setdefault((r["stage"], r["ranks"]), []).append(r)
        for (stage, ranks), rs in sorted(by_layout.items()):
            _, slope = _fit([(r["tensors"], r[cmd]["wall"]) for r in rs])
            marginal = f"{slope * 1e4:.2f}" if len(rs) > 1 else ""
            for r in rs:
                v = r[cmd]
                kib = f"{r['manifest_bytes'] / 1024:.0f}" if cmd == "generate" and "manifest_bytes" in r else ""
                lines.append(
                    f"| {r['tensors']:,} | {stage} | {ranks} | {cmd} | {v['wall']:.2f} | {v['cpu']:.2f} | "
                    f"{_goal(cmd, r)} | "
                    f"{v['wall'] / (r['tensors'] / 1e4):.2f} | {marginal} | {v['rss_mib']:.0f} | {kib} | "
                    f"{v.get('load', 0):.1f} |"
                )
    for r in rows_:
        if "skipped" in r:
            lines.append(
                f"| {r['tensors']:,} | {r['stage']} | {r['ranks']} | (skipped) | | | | | | | {r['skipped']} | |"
            )
    commands = {v["cmd"].replace(str(r["checkpoint"]), "CKPT") for r in done for v in r.values() if _is_cmd(v)}
    if commands:
        lines += ["", "Each row's command (CKPT: the N-tensor checkpoint of make_many_tensors.py):", ""]
        lines += [f"- `{c}`" for c in sorted(commands)]
    if done:
        lines += [
            "",
            "DeepSpeed itself (gloo, CPU; from bench.json):",
            "",
            "| N tensors | stage | ranks | frozen | tied | shard MB | build_model s | initialize s | 1 step s | "
            "save_checkpoint s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in done:
            t = r["deepspeed_times"]
            lines.append(
                f"| {r['tensors']:,} | {r['stage']} | {r['ranks']} | {r['frozen_tensors']} | {r['tied_aliases']} | "
                f"{r['shard_bytes'] / 1e6:.1f} | {t['build_model_s']} | {t['initialize_s']} | {t['train_steps_s']} | "
                f"{t['save_checkpoint_s']} |"
            )
    with_b = [r for r in done if "breakdown" in r]
    if with_b:
        names = list(with_b[0]["breakdown"]["steps"])
        lines += [
            "",
            "`generate` in one process, CPU s per step (validation is not part of generate):",
            "",
            "| N tensors | stage | ranks | " + " | ".join(names) + " |",
            "|---:|---:|---:|" + "---:|" * len(names),
        ]
        for r in with_b:
            s = r["breakdown"]["steps"]
            lines.append(
                f"| {r['tensors']:,} | {r['stage']} | {r['ranks']} | "
                + " | ".join(f"{s[k][1]:.2f}" for k in names)
                + " |"
            )
    loads = [x for r in done for x in r["loadavg"]]
    if loads:
        lines += [
            "",
            (
                f"{os.cpu_count()} CPUs, 1-min load average {min(loads):.1f}-{max(loads):.1f} during the runs; "
                f"`python -c pass` {done[0]['floor_s']:.2f} s, `ckptspec --version` {done[0]['cli_floor_s']:.2f} s "
                f"and {done[0]['cli_floor_mib']:.0f} MiB (the fixed cost in every row)."
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, action="append", help=f"default: {' '.join(map(str, SIZES))}")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--only",
        choices=["generate", "validate", "reconstruct"],
        action="append",
        help="commands to time (default: all)",
    )
    ap.add_argument("--build-timeout", type=float, default=None, help="seconds DeepSpeed may take per checkpoint")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--breakdown", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=int, metavar="N", help="print a cProfile of generate on the N-tensor checkpoint")
    args = ap.parse_args()
    if args.breakdown:
        print(json.dumps(breakdown(*args.breakdown)))
        return
    if args.profile:
        profile(str(build(args.profile, args.stage)))
        return
    result = rows(
        args.tensors or SIZES,
        stage=args.stage,
        runs=args.runs,
        commands=tuple(args.only or ("generate", "validate", "reconstruct")),
        build_timeout=args.build_timeout,
        log=lambda m: print(m, file=sys.stderr),
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()

"""Run one command as a child process and measure it: the one timer every benchmark uses.

The caller must import nothing heavy: on Linux a child's ``ru_maxrss`` starts at its
parent's peak RSS (the high-water mark is carried across fork and exec).
"""

from __future__ import annotations

import os
import subprocess
import time


def run_child(cmd: list[str], env: dict | None = None, ok_codes=(0,)) -> dict:
    """Wall seconds, CPU seconds (user + system), peak RSS (MiB), exit code and output tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.stdout.close()
    code = os.waitstatus_to_exitcode(status)
    if code not in ok_codes:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{out[-3000:]}")
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss_mib": usage.ru_maxrss / 1024,
        "code": code,
        "out": out[-2000:],
    }


def load_line(start: tuple[float, float, float]) -> str:
    """The load averages at a benchmark's ``start`` (``os.getloadavg()``) and now, and the core count."""
    end = os.getloadavg()
    return (
        f"load average (1, 5, 15 min) at start: {start[0]:.1f} {start[1]:.1f} {start[2]:.1f}; "
        f"at end: {end[0]:.1f} {end[1]:.1f} {end[2]:.1f}; {os.cpu_count()} cores"
    )

"""Settings of remote reads (``CKPTSPEC_REMOTE_*``), and the count of what was fetched."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


def _setting(name: str, default: int, least: int) -> int:
    """An integer setting from the environment (``CKPTSPEC_REMOTE_*``); a bad value keeps the default."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return max(value, least)


READ_AHEAD = 16 * 1024  # a read of metadata fetches at least this much (zip local headers, data.pkl)
TAIL = 64 * 1024  # the last bytes of a file, fetched at once: a zip's end record and central directory
# Bytes per range request of a bulk read, and requests in flight. An answer is held whole until it is
# used (fsspec reads it with aiohttp's read(), which joins its pieces: twice its size for a moment), so
# reconstruct's peak RSS grows by ~2.5 * IN_FLIGHT * CHUNK (measured by benchmarks/bench_remote.py: 8.5 MiB
# at 4 x 1 MiB, 3.0 MiB at 4 x 256 KiB, beside the 15 MiB of importing the HTTP backend; docs/remote.md).
CHUNK = _setting("CKPTSPEC_REMOTE_CHUNK", 256 * 1024, 64 * 1024)
IN_FLIGHT = _setting("CKPTSPEC_REMOTE_IN_FLIGHT", 4, 1)
# Bytes fetched by small reads (zip directories, pickles, local headers, small files) kept, so that a later
# read of the same command (a hash of every byte, a tensor) takes them instead of fetching them again.
KEPT_BYTES = 8 * 1024 * 1024

BACKENDS = {  # protocol -> the package that provides it, and the ckptspec extra that installs it
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "http"),
}


def _seconds(name: str, default: float, least: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value >= least else default


def timeout() -> float:
    """Seconds one request may take, connection and answer (``CKPTSPEC_REMOTE_TIMEOUT``, default 60).

    A deadline for the whole request, not only between bytes: a server that trickles a byte now
    and then times out too, after this long."""
    return _seconds("CKPTSPEC_REMOTE_TIMEOUT", 60.0, 0.001)


def retries() -> int:
    """Retries after a transient error, then the error stands (``CKPTSPEC_REMOTE_RETRIES``, default 3)."""
    return _setting("CKPTSPEC_REMOTE_RETRIES", 3, 0)


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (0 first): ``CKPTSPEC_REMOTE_BACKOFF`` (default 0.25), doubled each time."""
    return _seconds("CKPTSPEC_REMOTE_BACKOFF", 0.25, 0.0) * 2**attempt


@dataclass(frozen=True)
class Fetched:
    """Bytes of file content fetched from remote locations, and the requests made, since ``forget()``."""

    bytes: int = 0
    requests: int = 0


_lock = threading.Lock()
_counts = {"bytes": 0, "requests": 0}


def fetched() -> Fetched:
    with _lock:
        return Fetched(_counts["bytes"], _counts["requests"])


def reset() -> None:
    with _lock:
        _counts.update(bytes=0, requests=0)


def count(nbytes: int, requests: int = 1) -> None:
    with _lock:
        _counts["bytes"] += nbytes
        _counts["requests"] += requests

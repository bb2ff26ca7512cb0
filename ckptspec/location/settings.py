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
CHUNK = _setting("CKPTSPEC_REMOTE_CHUNK", 1024 * 1024, 64 * 1024)  # bytes per range request of a bulk read
IN_FLIGHT = _setting("CKPTSPEC_REMOTE_IN_FLIGHT", 4, 1)  # requests in flight: memory ~ 2 * IN_FLIGHT * CHUNK
RETRIES = _setting("CKPTSPEC_REMOTE_RETRIES", 3, 0)  # retries after a transient error (then the error stands)
BACKOFF = 0.25  # seconds before the first retry; doubled for each next one
TAILS_KEPT = 8  # recent files' tails kept, so that a zip directory read twice is fetched once

BACKENDS = {  # protocol -> the package that provides it, and the ckptspec extra that installs it
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "http"),
}


def timeout() -> float:
    """Seconds to wait for a connection or for the next bytes of an answer (``CKPTSPEC_REMOTE_TIMEOUT``)."""
    try:
        value = float(os.environ.get("CKPTSPEC_REMOTE_TIMEOUT", "60"))
    except ValueError:
        value = 60.0
    return value if value > 0 else 60.0


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

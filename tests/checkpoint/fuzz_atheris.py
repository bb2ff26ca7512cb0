"""Coverage-guided fuzzing of ckptspec.torchfile with atheris: optional, not part of the suite.

    .venv/bin/pip install atheris
    .venv/bin/python tests/checkpoint/fuzz_atheris.py --make-corpus /tmp/ckptspec-corpus
    .venv/bin/python tests/checkpoint/fuzz_atheris.py /tmp/ckptspec-corpus \\
        -max_total_time=600 -rss_limit_mb=1024 -timeout=30

The first byte of an input chooses what the rest is: a whole .pt file (0), a data.pkl put in a
torch-like zip with three storages (1), or a safetensors file (2). The oracle is the one of
tests/checkpoint/test_torchfile_fuzz.py (``read_everything``): only TorchFileError (CkptspecError for
safetensors) may escape, no code may run, and what reads back must be consistent; libFuzzer's
own limits catch crashes, hangs (-timeout) and memory growth (-rss_limit_mb). A failing input
is saved as crash-<sha1> (or oom-, timeout-); keep it as a deterministic test in
tests/checkpoint/test_torchfile_fuzz.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["ckptspec", "zipfile"]):
    import zipfile  # noqa: F401  (instrumented: its parsing of the central directory is under test)

    import test_torchfile_fuzz as T

    from ckptspec.checkpoint.embedded import read_safetensors_metadata
    from ckptspec.errors import CkptspecError

STORAGES = {"0": 48, "1": 16, "2": 4096}
WORK = Path(tempfile.mkdtemp(prefix="ckptspec-atheris-"))


def one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 3, data[1:]
    if mode == 0:
        T.read_everything(T.write(WORK / "in.pt", body))
    elif mode == 1:
        T.read_everything(T.write(WORK / "in.pt", T.torch_zip(body, STORAGES)))
    else:
        path = T.write(WORK / "in.safetensors", body)
        try:
            meta = read_safetensors_metadata(path)
        except CkptspecError:
            return
        assert isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())


def make_corpus(directory: Path) -> None:
    import struct

    directory.mkdir(parents=True, exist_ok=True)
    for name, seed in T.seeds().items():
        (directory / f"file-{name}").write_bytes(b"\x00" + seed.file)
        (directory / f"pkl-{name}").write_bytes(b"\x01" + seed.pkl)
    header = (
        b'{"__metadata__": {"ckptspec.manifest": "{}"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    )
    (directory / "safetensors").write_bytes(b"\x02" + struct.pack("<Q", len(header)) + header + bytes(4))
    print(f"wrote {len(list(directory.iterdir()))} seeds to {directory}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(Path(sys.argv[2]))
        sys.exit(0)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with T.sandbox():
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()

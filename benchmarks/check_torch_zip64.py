"""Check ``checkpoint/torch_zip`` against ``torch.save`` past 4 GiB (zip64), where the suite cannot go.

    .venv/bin/python benchmarks/check_torch_zip64.py [DIR]

Two files torch.save writes (a record starting past 4 GiB; a record of 4.3 GB), each written again
record by record through ``TorchZipWriter`` in 16 MiB chunks, compared byte for byte. Needs ~9 GB of
disk under DIR (default: a temporary directory) and ~4.5 GB of memory (torch.save's tensors).
"""

from __future__ import annotations

import filecmp
import gc
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from ckptspec.checkpoint.torch_zip import TorchZipWriter
from ckptspec.export import ds_pickle


def _chunks(z, info):
    with z.open(info) as f:
        while block := f.read(16 << 20):
            yield block


def _rewrite(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as z:
        writer = TorchZipWriter(dst)
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]
            if name not in ("version", ".data/serialization_id"):
                writer.write_record(name, _chunks(z, info), info.file_size)
        writer.close(ds_pickle.torch_trailer)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="zip64-", dir=sys.argv[1] if len(sys.argv) > 1 else None))
    u8 = torch.uint8
    cases = {
        "offset": lambda: [torch.full((3_100_000_000,), 7, dtype=u8), torch.full((1_200_000_000,), 3, dtype=u8)],
        "size": lambda: {"x": torch.full((4_300_000_000,), 5, dtype=u8), "y": torch.arange(5)},
    }
    try:
        (root / "again").mkdir()
        for name, make in cases.items():
            obj = make()
            torch.save(obj, root / f"{name}.pt")
            del obj
            gc.collect()
            _rewrite(root / f"{name}.pt", root / "again" / f"{name}.pt")
            same = filecmp.cmp(root / f"{name}.pt", root / "again" / f"{name}.pt", shallow=False)
            print(f"| {name} | {(root / f'{name}.pt').stat().st_size} bytes | {'identical' if same else 'DIFFERENT'} |")
            (root / f"{name}.pt").unlink()
            (root / "again" / f"{name}.pt").unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

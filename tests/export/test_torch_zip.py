"""``checkpoint/torch_zip``: torch's zip format written record by record, each from chunks.

The oracle is ``torch.save`` itself: every record of a file it wrote, written again through
``TorchZipWriter`` in small chunks, gives the same file byte for byte (headers, alignment padding,
data descriptors, the serialization id, the directory); and ``ds_pickle.save_streamed`` with
``shapes_as_tuples`` writes what ``torch.save`` writes for the same tensors (views, shared
storages, ties, empty tensors)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptspec.checkpoint.torch_zip import TorchZipWriter  # noqa: E402
from ckptspec.export import ds_pickle  # noqa: E402


def _rewrite(src, dst):
    with zipfile.ZipFile(src) as z:
        writer = TorchZipWriter(dst)
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]
            if name in ("version", ".data/serialization_id"):
                continue  # written by close(), as torch's writer writes them
            data = z.read(info.filename)
            writer.write_record(name, [data[i : i + 5] for i in range(0, len(data), 5)], len(data))
        writer.close(ds_pickle.torch_trailer)


OBJECTS = {
    "plain": {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16), "n": 1},
    "many": [torch.randn(i + 1) for i in range(25)],  # storage keys past 9
    "none": {"x": 1},
    "empty": {"e": torch.empty(0), "x": torch.ones(3), "f": torch.empty(0, 3)},
    "views": (lambda f: {"f": f, "v": f[3:9].view(2, 3), "w": f[10:]})(torch.randn(100)),
}


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_records_written_again_in_chunks_give_torch_saves_file(tmp_path, name):
    (tmp_path / "again").mkdir()
    torch.save(OBJECTS[name], tmp_path / f"{name}.pt")
    _rewrite(tmp_path / f"{name}.pt", tmp_path / "again" / f"{name}.pt")  # same name: same archive prefix
    assert (tmp_path / "again" / f"{name}.pt").read_bytes() == (tmp_path / f"{name}.pt").read_bytes()


def test_save_streamed_writes_torch_saves_bytes_for_views_ties_and_shared_storages(tmp_path):
    flat = torch.arange(24, dtype=torch.float32).to(torch.bfloat16)
    frozen = torch.randn(2, 2)
    buffer = torch.zeros(3, dtype=torch.long)
    w = flat[0:6].view(2, 3)
    reference = {
        "module": {"w": w, "tie": w, "b": flat[8:12], "z": flat[12:12].view(0, 4), "frozen": frozen, "buf": buffer},
        "fragments": {"frozen": frozen},
        "view_again": buffer[1:],
        "step": 3,
    }
    # the same content as lazy tensors: the flat buffer produced in uneven chunks, only when written
    bits = flat.view(torch.int16).numpy()
    produced = []

    def chunks():
        produced.append("flat")
        yield from (bits[i : i + 7] for i in range(0, 24, 7))

    lazy = ds_pickle.Lazy("bfloat16", (24,), chunks)
    lw = ds_pickle.View(lazy, (2, 3), 0)
    streamed = {
        "module": {
            "w": lw,
            "tie": lw,
            "b": ds_pickle.View(lazy, (4,), 8),
            "z": ds_pickle.View(lazy, (0, 4), 12),
            "frozen": frozen,
            "buf": buffer,
        },
        "fragments": {"frozen": frozen},
        "view_again": buffer[1:],
        "step": 3,
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ds_pickle.save(reference, tmp_path / "a" / "m.pt")
    ds_pickle.save_streamed(streamed, tmp_path / "b" / "m.pt", shapes_as_tuples=True)
    assert produced == ["flat"]
    assert (tmp_path / "b" / "m.pt").read_bytes() == (tmp_path / "a" / "m.pt").read_bytes()
    back = torch.load(tmp_path / "b" / "m.pt", weights_only=False)
    assert back["module"]["w"].data_ptr() == back["module"]["tie"].data_ptr()
    assert torch.equal(back["module"]["b"], flat[8:12])


def test_chunks_adding_up_to_the_wrong_size_are_an_error(tmp_path):
    lazy = ds_pickle.Lazy("float32", (4,), lambda: iter([np.zeros(2, np.float32), np.zeros(1, np.float32)]))
    with pytest.raises(ValueError, match="produced 12 bytes"):
        ds_pickle.save_streamed({"x": lazy}, tmp_path / "f.pt")

"""The restricted reader of a DCP ``.metadata`` on hand-assembled pickles (no torch): what DCP writes is read; a
global off the allowlist, a record built twice or with arguments, a value of the wrong type, a persistent id are
refused with their codes; what a record holds is checked once the pickle has run to its end. The real saves are
tests/dcp/test_dcp_metadata.py's."""

from __future__ import annotations

import struct

import pytest

from ckptspec.checkpoint.dcp.metadata import Chunk, read_metadata
from ckptspec.errors import TorchFileError, UnsafePickleError

MD = "torch.distributed.checkpoint.metadata"


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def num(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def size(*values: int) -> bytes:
    return glob("torch", "Size") + b"(" + b"".join(num(v) for v in values) + b"t\x85R"


def record(name: str, state: bytes, module: str = MD) -> bytes:
    """NEWOBJ of the class, then BUILD with ``state`` (already a pushed dict or tuple)."""
    return glob(module, name) + b")\x81" + state + b"b"


def mapping(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}" + b"".join(k + v + b"s" for k, v in pairs)


def chunk(offset: int, length: int) -> bytes:
    return record("ChunkStorageMetadata", mapping((text("offsets"), size(offset)), (text("sizes"), size(length))))


def tensor(chunks: bytes, dtype: bytes = glob("torch", "float32")) -> bytes:
    props = record("TensorProperties", b"(" + dtype + b"t")
    return record(
        "TensorStorageMetadata",
        mapping((text("properties"), props), (text("size"), size(4)), (text("chunks"), chunks)),
    )


def item(offset: int) -> tuple[bytes, bytes]:
    key = record(
        "MetadataIndex", mapping((text("fqn"), text("w")), (text("offset"), size(offset)), (text("index"), num(0)))
    )
    info = record(
        "_StorageInfo",
        mapping((text("relative_path"), text("__0_0.distcp")), (text("offset"), num(0)), (text("length"), num(10))),
        "torch.distributed.checkpoint.filesystem",
    )
    return key, info


def metadata(entry: bytes, extra: bytes = b"") -> bytes:
    state = mapping(
        (text("state_dict_metadata"), mapping((text("w"), entry))), (text("storage_data"), mapping(item(0)))
    )
    return b"\x80\x02" + extra + record("Metadata", state) + b"."


def write(tmp_path, data: bytes):
    (tmp_path / ".metadata").write_bytes(data)
    return tmp_path


def test_what_dcp_writes_is_read(tmp_path):
    meta = read_metadata(write(tmp_path, metadata(tensor(b"]" + chunk(0, 4) + b"a"))))
    assert meta.entries["w"].dtype == "float32" and meta.entries["w"].chunks == (Chunk((0,), (4,)),)
    assert [(i.fqn, i.file, i.offset, i.length) for i in meta.items] == [("w", "__0_0.distcp", 0, 10)]


@pytest.mark.parametrize(
    "global_", [("posix", "system"), ("builtins", "eval"), ("torch", "load"), (MD, "TensorStorageMetadataX")]
)
def test_a_global_off_the_list_is_refused_by_name(tmp_path, global_):
    data = b"\x80\x02" + glob(*global_) + b"(" + text("touch x") + b"tR."
    with pytest.raises(UnsafePickleError, match=f"global {global_[0]}.{global_[1]}, which is not allowlisted") as e:
        read_metadata(write(tmp_path, data))
    assert e.value.code == "CK204"


CASES = {
    "built twice": tensor(b"]" + chunk(0, 4) + b"a") + mapping() + b"b",  # a second BUILD
    "built with arguments": glob(MD, "Metadata") + b"(" + num(1) + b"t\x81",
    "not an int64 size": tensor(
        b"]" + record("ChunkStorageMetadata", mapping((text("offsets"), size(-1)), (text("sizes"), size(4)))) + b"a"
    ),
    "no torch dtype": tensor(b"]" + chunk(0, 4) + b"a", dtype=text("float32")),
    "chunks are": tensor(mapping()),
    "persistent id": b"P0\n",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_dcp_never_writes_is_refused(tmp_path, case):
    body = CASES[case]
    data = b"\x80\x02" + body + b"." if case in ("built with arguments", "persistent id") else metadata(body)
    with pytest.raises(TorchFileError) as e:
        read_metadata(write(tmp_path, data))
    assert e.value.code == "CK205"
    assert case.split(" ")[-1] in str(e.value) or case in str(e.value)


def test_what_a_record_holds_is_checked_after_the_pickle_ran(tmp_path):
    """The chunks list is memoized, given to the tensor's BUILD, then something else appended to it once the whole
    Metadata was built: the conversion reads the records after the pickle has run to its end, and refuses it."""
    entry = tensor(b"]q\x00" + chunk(0, 4) + b"a")  # the list, memo 0
    late = b"h\x00" + num(7) + b"a0"  # get it back, append an int, pop it off the stack
    data = metadata(entry)
    with pytest.raises(TorchFileError, match="w: chunk 1 is a int"):
        read_metadata(write(tmp_path, data[:-1] + late + b"."))


PLANNER = "torch.distributed.checkpoint.planner"


def with_plans(plans: bytes) -> bytes:
    """A Metadata whose state also holds Megatron-core's ``all_local_plans``."""
    state = mapping(
        (text("state_dict_metadata"), mapping((text("w"), tensor(b"]" + chunk(0, 4) + b"a")))),
        (text("storage_data"), mapping(item(0))),
        (text("all_local_plans"), plans),
    )
    return b"\x80\x02" + record("Metadata", state) + b"."


def plan(kind: int) -> bytes:
    """A rank's ``SavePlan`` as Megatron-core's torch_dist pickles it: its write items, each typed by the enum."""
    kind_ = glob(PLANNER, "WriteItemType") + b"(" + num(kind) + b"tR"
    write_item = record("WriteItem", mapping((text("type"), kind_), (text("bytes_io_data"), b"N")), PLANNER)
    return record("SavePlan", mapping((text("items"), b"]" + write_item + b"a"), (text("usable"), b"\x88")), PLANNER)


def test_megatrons_save_plans_are_read_and_not_used(tmp_path):
    meta = read_metadata(write(tmp_path, with_plans(b"](" + plan(1) + plan(3) + b"e")))
    assert list(meta.entries) == ["w"] and len(meta.items) == 1


@pytest.mark.parametrize(
    ("plans", "message"),
    [
        (text("plans"), "all_local_plans is str, not a list of SavePlan"),
        (b"]" + tensor(b"]" + chunk(0, 4) + b"a") + b"a", "all_local_plans is list, not a list of SavePlan"),
        (b"]" + plan(9) + b"a", "unknown WriteItemType 9"),
    ],
)
def test_what_megatron_never_writes_in_its_plans_is_refused(tmp_path, plans, message):
    with pytest.raises(TorchFileError, match=message) as e:
        read_metadata(write(tmp_path, with_plans(plans)))
    assert e.value.code == "CK205"

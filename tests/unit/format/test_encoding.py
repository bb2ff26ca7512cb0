"""Encodings (issue #6): canonical JSON and msgpack, lossless both ways, atomic writes, `ckptspec convert`."""

from __future__ import annotations

import copy
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptspec._fs import atomic_output, write_atomic
from ckptspec.cli import cli
from ckptspec.errors import NotEncodable
from ckptspec.format.codec import decode, dumps, encoding_for_output, load_document
from ckptspec.format.models import Manifest
from ckptspec.format.validate import validate_document

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "conformance" / "1.0"
VALID = sorted((CORPUS / "valid").glob("*.json")) + sorted((CORPUS / "valid").glob("*.msgpack"))
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
KNOWN_TOP = {
    "format",
    "format_version",
    "producer",
    "layout",
    "groups",
    "frozen",
    "buffers",
    "aliases",
    "excluded",
    "files",
    "optimizer",  # format 1.1
    "save",
}


def same(a, b) -> bool:
    """Equal *and* of the same JSON types all the way down (3 is not 3.0, True is not 1, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a.hex() == b.hex()
    return a == b


@pytest.fixture
def run(ckptspec_process):
    """``run(*args)``: ``ckptspec ARGS`` in a process of its own (the harness's fork server)."""
    return lambda *args: ckptspec_process(args)


# --------------------------------------------------------------------------- canonical forms


def test_canonical_json_is_sorted_utf8_indented():
    doc = {"b": 1, "a": {"z": "é€😀", "y": [3, 2.5, None, True]}}
    text = dumps(doc, "json").decode("utf-8")
    assert text == (
        '{\n  "a": {\n    "y": [\n      3,\n      2.5,\n      null,\n      true\n    ],\n'
        '    "z": "é€😀"\n  },\n  "b": 1\n}\n'
    )
    assert dumps(doc, "json", compact=True) == '{"a":{"y":[3,2.5,null,true],"z":"é€😀"},"b":1}'.encode()


def test_canonical_msgpack_sorts_keys_at_every_level():
    one = {"b": {"y": 1, "x": 2}, "a": [{"d": 1, "c": 2}]}
    other = {"a": [{"c": 2, "d": 1}], "b": {"x": 2, "y": 1}}
    assert dumps(one, "msgpack") == dumps(other, "msgpack")
    assert list(msgpack.unpackb(dumps(one, "msgpack"))) == ["a", "b"]


def test_model_and_plain_document_give_the_same_bytes():
    doc = json.loads(EXAMPLE.read_text("utf-8"))
    manifest = Manifest.model_validate(doc)
    for encoding in ("json", "msgpack"):
        assert dumps(manifest, encoding) == dumps(doc, encoding)


@pytest.mark.parametrize(
    "value,encoding",
    [
        (float("nan"), "json"),
        (float("inf"), "json"),
        (b"bytes", "json"),
        ("\ud800", "json"),
        (2**64, "msgpack"),
        (-(2**63) - 1, "msgpack"),
        (object(), "msgpack"),
    ],
)
def test_unrepresentable_values_are_refused_not_altered(value, encoding):
    with pytest.raises(NotEncodable) as info:
        dumps({"x": value}, encoding)
    assert info.value.code == "CK907" and info.value.exit_code == 1


def test_integer_range_both_encodings_share():
    for value in (0, -1, 2**63 - 1, -(2**63), 2**64 - 1):
        for encoding in ("json", "msgpack"):
            back = decode(dumps({"n": value}, encoding), encoding)
            assert same(back, {"n": value})


def test_encoding_for_output():
    assert encoding_for_output("a.msgpack") == encoding_for_output("a.MPK") == "msgpack"
    assert encoding_for_output("a.json") == encoding_for_output("a.bin") == encoding_for_output("-") == "json"
    assert encoding_for_output("a.json", "msgpack") == "msgpack"


# --------------------------------------------------------------------------- lossless round trip (property)


def _corpus_docs() -> list[tuple[str, dict]]:
    return [(p.name, load_document(p)) for p in VALID]


CORPUS_DOCS = _corpus_docs()
# Any code point, lone surrogates included (and often: they are rare among all code points).
CHARS = st.characters(exclude_categories=()) | st.characters(categories=["Cs"])
TEXT = st.text(CHARS, min_size=1, max_size=30)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(CHARS, max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(CHARS, max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def valid_manifests(draw) -> dict:
    """A conformance-corpus manifest with random changes that keep it valid, unless a string
    drawn holds a lone surrogate."""
    name, original = draw(st.sampled_from(CORPUS_DOCS))
    doc = copy.deepcopy(original)
    producer = doc["producer"]
    for field in ("tool", "tool_version", "framework", "framework_version"):
        if draw(st.booleans()):
            producer[field] = draw(TEXT)
    if draw(st.booleans()):
        producer["metadata"] = draw(
            st.dictionaries(st.text(CHARS, max_size=12), st.text(CHARS, max_size=40), max_size=4)
        )
    if draw(st.booleans()):
        # A count written as an integral float is valid (JSON Schema counts 2.0 as an integer).
        doc["layout"]["world_size"] = float(doc["layout"]["world_size"])
    for excluded in doc["excluded"]:
        if draw(st.booleans()):
            excluded["reason"] = draw(TEXT)
    if draw(st.booleans()):
        # A newer minor: fields this reader does not know are kept, whatever JSON they hold.
        doc["format_version"] = f"1.{draw(st.integers(2, 99))}.{draw(st.integers(0, 9))}"
        extra = draw(st.dictionaries(TEXT.filter(lambda k: k not in KNOWN_TOP), JSON_VALUES, min_size=1, max_size=3))
        doc.update(extra)
        layout_extra = draw(
            st.dictionaries(
                TEXT.filter(lambda k: k not in doc["layout"] and k != "byte_order"), JSON_VALUES, max_size=2
            )
        )
        doc["layout"].update(layout_extra)
    return doc


def _holds_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_lone_surrogate(v) for v in value)
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(valid_manifests())
def test_json_msgpack_round_trip_is_lossless(doc):
    report = validate_document(doc)
    if _holds_lone_surrogate(doc):
        # Not Unicode text: never an exception; any error the validator finds is that (a newer
        # minor's unknown fields are kept as they are); both encoders refuse it, never alter it.
        errors = [f for f in report.findings if f.severity == "error"]
        assert all(f.code == "CK001" and "lone surrogate" in f.message for f in errors), report.findings
        for encoding in ("json", "msgpack"):
            with pytest.raises(NotEncodable):
                dumps(doc, encoding)
        return
    assert report.ok, [f.to_line() for f in report.findings]
    as_json, as_msgpack = dumps(doc, "json"), dumps(doc, "msgpack")
    from_json, from_msgpack = decode(as_json, "json"), decode(as_msgpack, "msgpack")
    assert same(from_json, doc) and same(from_msgpack, doc)
    # Through the other encoding and back: the same canonical bytes.
    assert dumps(from_msgpack, "json") == as_json
    assert dumps(from_json, "msgpack") == as_msgpack
    # The validator reads both the same way.
    assert validate_document(from_msgpack).findings == validate_document(from_json).findings == report.findings


def test_corpus_msgpack_twins_equal_their_json():
    for twin in sorted(CORPUS.rglob("*.msgpack")):
        assert same(load_document(twin), load_document(twin.with_suffix(".json"))), twin.name


# --------------------------------------------------------------------------- atomic writes


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    target.chmod(0o640)
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the existing file's mode is kept
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_new_file_gets_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "n.json", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "n.json").stat().st_mode) == 0o644


def test_failed_write_leaves_old_file_untouched(tmp_path):
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as fh:
            fh.write(b"partial")
            raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


# --------------------------------------------------------------------------- ckptspec convert


def test_convert_json_msgpack_json_reproduces_canonical_bytes(tmp_path, run):
    packed, back = tmp_path / "m.msgpack", tmp_path / "m.json"
    first = run("convert", str(EXAMPLE), str(packed))
    assert first.returncode == 0, first.stderr
    assert first.stdout == f"{packed}: written (msgpack, {packed.stat().st_size} bytes)\n"
    assert run("convert", str(packed), str(back)).returncode == 0
    assert back.read_bytes() == dumps(json.loads(EXAMPLE.read_text("utf-8")), "json")
    assert packed.stat().st_size < back.stat().st_size
    assert run("validate", str(packed)).returncode == 0


def test_convert_to_stdout_and_explicit_encoding(tmp_path, run):
    result = subprocess.run(
        [sys.executable, "-m", "ckptspec", "convert", str(EXAMPLE), "-", "--encoding", "msgpack"], capture_output=True
    )
    assert result.returncode == 0
    assert result.stdout == dumps(json.loads(EXAMPLE.read_text("utf-8")), "msgpack")
    weird = tmp_path / "manifest.bin"
    assert run("convert", str(EXAMPLE), str(weird), "--encoding", "msgpack").returncode == 0
    assert run("convert", str(weird), str(tmp_path / "x.json"), "--input-encoding", "msgpack").returncode == 0


def test_convert_refuses_an_invalid_manifest_and_writes_nothing(tmp_path, run):
    bad = CORPUS / "invalid" / "CK101-numel-shape-scalar-numel-0.json"
    out = tmp_path / "out.msgpack"
    result = run("convert", str(bad), str(out))
    assert result.returncode == 1
    assert "CK101" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_convert_keeps_unknown_fields_of_a_newer_minor_with_a_warning(tmp_path, run):
    newer = CORPUS / "valid" / "newer-minor-1.4.0-unknown-fields.json"
    packed, back = tmp_path / "n.msgpack", tmp_path / "n.json"
    result = run("convert", str(newer), str(packed))
    assert result.returncode == 0
    assert "CK004 warning:" in result.stderr
    run("convert", str(packed), str(back))
    assert same(json.loads(back.read_text("utf-8")), json.loads(newer.read_text("utf-8")))


def test_convert_unknown_major_exits_1_with_a_clear_message(tmp_path, run):
    major = CORPUS / "invalid" / "CK003-format-major-2.json"
    result = run("convert", str(major), str(tmp_path / "x.msgpack"))
    assert result.returncode == 1
    assert "CK003 format version 2.0.0 has major 2; this reader understands major 1 only" in result.stderr
    assert not (tmp_path / "x.msgpack").exists()


def test_convert_value_msgpack_cannot_hold(tmp_path, run):
    doc = json.loads((CORPUS / "valid" / "newer-minor-1.4.0-unknown-fields.json").read_text("utf-8"))
    doc["future_counter"] = 2**70
    source = tmp_path / "big.json"
    source.write_text(json.dumps(doc), "utf-8")
    result = run("convert", str(source), str(tmp_path / "big.msgpack"))
    assert result.returncode == 1
    assert "CK907" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "big.msgpack").exists()


def test_convert_io_errors_exit_2(tmp_path, run):
    missing = run("convert", str(tmp_path / "nope.json"), str(tmp_path / "x.json"))
    assert missing.returncode == 2 and "CK901 file not found" in missing.stderr
    unwritable = run("convert", str(EXAMPLE), str(tmp_path / "no" / "dir" / "x.json"))
    assert unwritable.returncode == 2 and "CK906" in unwritable.stderr


def test_convert_in_process_matches_subprocess(tmp_path):
    out = tmp_path / "m.msgpack"
    result = CliRunner().invoke(cli, ["convert", str(EXAMPLE), str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == dumps(json.loads(EXAMPLE.read_text("utf-8")), "msgpack")


# ------------------------------------------------------------------ size and speed (benchmarks/bench_encoding.py)


def test_benchmark_manifest_is_valid_and_msgpack_is_smaller():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_encoding import measure, synthetic_manifest
    finally:
        sys.path.pop(0)
    manifest = synthetic_manifest(600)
    assert validate_document(manifest.to_dict()).findings == []
    rows = {row["encoding"]: row for row in measure(600, repeat=1)}
    assert rows["msgpack"]["bytes"] < 0.5 * rows["json"]["bytes"]
    assert all(math.isfinite(row["decode_validate_s"]) for row in rows.values())

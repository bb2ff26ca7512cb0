"""Hostile and broken input: never a traceback, always the right code and exit status.

The CLI cases call ``ckptspec.cli.main`` (the console-script entry point, which turns any
unexpected exception into CK999) in-process, and check the exit status, the code, and that
no exception escapes and no CK999 appears; a few cases also run the installed ``ckptspec``
command in a subprocess (the sparse 3 GB file under a 1 GB memory limit, for one). The fuzz
tests feed random bytes, random JSON values and randomly mutated real manifests to
``codec.decode`` + ``validate_document``:
they may only raise ``CkptspecError`` or return a ``Report``, and a ``CK002`` finding
(schema and models disagree, a ckptspec bug) must never appear.

``CKPTSPEC_FUZZ_EXAMPLES=5000 pytest tests/unit/cli/test_bad_input.py -k fuzz`` runs a longer fuzz.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptspec.cli import main as cli_main
from ckptspec.errors import CkptspecError
from ckptspec.format import codec
from ckptspec.format.validate import Report, validate_document

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
BASE = json.loads(EXAMPLE.read_text("utf-8"))
FUZZ_EXAMPLES = int(os.environ.get("CKPTSPEC_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=FUZZ_EXAMPLES <= 300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _command() -> list[str]:
    script = Path(sys.executable).with_name("ckptspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptspec"]


def run_cli(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPTSPEC_DEBUG"}
    return subprocess.run(
        [*_command(), *args], capture_output=True, text=True, timeout=timeout, env=env, errors="replace", **kwargs
    )


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run ``ckptspec ARGS`` through the console-script entry point, in-process."""

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", ["ckptspec", *args])
        monkeypatch.delenv("CKPTSPEC_DEBUG", raising=False)
        with pytest.raises(SystemExit) as exc:
            cli_main()
        out, err = capsys.readouterr()
        status = exc.value.code
        return subprocess.CompletedProcess(args, 0 if status is None else status, out, err)

    return run


def assert_refused(result: subprocess.CompletedProcess, exit_code: int, code: str) -> None:
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    assert "CK999" not in out, out
    assert result.returncode == exit_code, f"exit {result.returncode}, expected {exit_code}:\n{out}"
    assert code in out, f"expected {code}:\n{out}"
    lines = [line for line in out.splitlines() if line.strip()]
    if result.stdout.lstrip().startswith("{"):
        return
    # Text output: every line is `where: CODE message (hint: ...)`.
    for line in lines:
        assert re.search(r": (CK\d{3}) .*\(hint: .*\)$", line), f"not a finding line: {line!r}"


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def manifest_with(**changes) -> dict:
    doc = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = doc
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value
    return doc


# --------------------------------------------------------------------------- the CLI on bad files

EXAMPLE_TEXT = EXAMPLE.read_text("utf-8")

# name, file name, bytes, extra CLI args, expected exit, expected code
CASES = [
    ("malformed-json", "m.json", '{"format": }', [], 2, "CK903"),
    ("truncated-json", "t.json", EXAMPLE_TEXT[: len(EXAMPLE_TEXT) // 2], [], 2, "CK903"),
    ("trailing-garbage", "g.json", EXAMPLE_TEXT + "}", [], 2, "CK903"),
    (
        "wrong-types",
        "w.json",
        json.dumps(manifest_with(groups__0__params__0__numel="800", layout__round_robin=0)),
        [],
        1,
        "CK001",
    ),
    ("giant-integer", "i.json", '{"format": "ckptspec.manifest", "n": 1' + "0" * 5000 + "}", [], 2, "CK903"),
    (
        "giant-integer-as-numel",
        "i2.json",
        EXAMPLE_TEXT.replace('"numel": 800', '"numel": 1' + "0" * 5000, 1),
        [],
        2,
        "CK903",
    ),
    ("numel-1e30", "n.json", json.dumps(manifest_with(groups__0__params__0__numel=10**30)), [], 1, "CK001"),
    ("numel-float-1e30", "nf.json", EXAMPLE_TEXT.replace('"numel": 800', '"numel": 1e30', 1), [], 1, "CK001"),
    (
        "numel-1e400-overflows-to-inf",
        "inf.json",
        EXAMPLE_TEXT.replace('"numel": 800', '"numel": 1e400', 1),
        [],
        1,
        "CK001",
    ),
    ("deep-arrays-100000", "d.json", "[" * 100_000 + "]" * 100_000, [], 2, "CK903"),
    ("deep-objects-100000", "o.json", '{"a":' * 100_000 + "1" + "}" * 100_000, [], 2, "CK903"),
    ("deep-unclosed", "u.json", "[" * 100_000, [], 2, "CK903"),
    ("non-utf8", "l.json", b'{"format": "caf\xe9"}', [], 2, "CK903"),
    ("utf16", "u16.json", EXAMPLE_TEXT.encode("utf-16"), [], 2, "CK903"),
    ("utf8-bom", "bom.json", b"\xef\xbb\xbf" + EXAMPLE_TEXT.encode(), [], 2, "CK903"),
    ("empty", "e.json", b"", [], 2, "CK903"),
    ("whitespace-only", "ws.json", b" \n\t ", [], 2, "CK903"),
    ("nul-bytes", "z.json", b"\x00" * 64, [], 2, "CK903"),
    ("top-level-array", "a.json", "[1, 2, 3]", [], 1, "CK001"),
    ("top-level-string", "s.json", '"ckptspec.manifest"', [], 1, "CK001"),
    ("top-level-number", "num.json", "42", [], 1, "CK001"),
    ("top-level-null", "null.json", "null", [], 1, "CK001"),
    ("nan", "nan.json", '{"format_version": NaN}', [], 2, "CK903"),
    ("infinity", "pinf.json", EXAMPLE_TEXT.replace('"numel": 800', '"numel": Infinity', 1), [], 2, "CK903"),
    ("minus-infinity", "minf.json", "[-Infinity]", [], 2, "CK903"),
    ("duplicate-top-level-key", "dup.json", '{"format": "a", "format": "b"}', [], 1, "CK904"),
    (
        "duplicate-nested-key",
        "dup2.json",
        EXAMPLE_TEXT.replace('"world_size": 2,', '"world_size": 2, "world_size": 3,', 1),
        [],
        1,
        "CK904",
    ),
    ("bad-msgpack-truncated", "b.msgpack", b"\x82\xa1a\x01", [], 2, "CK903"),
    ("bad-msgpack-reserved-byte", "r.msgpack", b"\xc1", [], 2, "CK903"),
    ("msgpack-extra-data", "x.msgpack", msgpack.packb({"a": 1}) + b"\x01", [], 2, "CK903"),
    ("msgpack-integer-keys", "k.msgpack", msgpack.packb({1: 2}), [], 2, "CK903"),
    ("msgpack-binary-keys", "bk.msgpack", msgpack.packb({b"format": 1}, use_bin_type=True), [], 2, "CK903"),
    ("msgpack-duplicate-keys", "dk.msgpack", b"\x82\xa1a\x01\xa1a\x02", [], 1, "CK904"),
    ("msgpack-invalid-utf8-string", "s8.msgpack", b"\x81\xa1a\xa1\xff", [], 2, "CK903"),
    ("msgpack-deep-100000", "deep.msgpack", b"\x91" * 100_000 + b"\x90", [], 2, "CK903"),
    ("msgpack-on-json", "j.json", EXAMPLE_TEXT, ["--encoding", "msgpack"], 2, "CK903"),
    ("json-on-msgpack", "p.msgpack", msgpack.packb(BASE), ["--encoding", "json"], 2, "CK903"),
    ("sniffed-msgpack-garbage", "noext", b"\x8f", [], 2, "CK903"),
]


@pytest.mark.parametrize("name,filename,data,args,exit_code,code", CASES, ids=[c[0] for c in CASES])
def test_cli_refuses(cli, tmp_path, name, filename, data, args, exit_code, code):
    path = write(tmp_path, filename, data)
    assert_refused(cli("validate", *args, str(path)), exit_code, code)
    report = cli("validate", "--format", "json", *args, str(path))
    assert report.returncode == exit_code
    parsed = json.loads(report.stdout)  # the JSON report is still one JSON object
    assert parsed["valid"] is False
    codes = [f["code"] for f in parsed["findings"]] + ([parsed["error"]["code"]] if "error" in parsed else [])
    assert code in codes


def test_cli_valid_msgpack(cli, tmp_path):
    path = write(tmp_path, "ok.msgpack", msgpack.packb(BASE))
    result = cli("validate", str(path))
    assert result.returncode == 0 and result.stdout.strip().endswith(": valid"), result.stdout + result.stderr


def test_cli_directory(cli, tmp_path):
    # `validate DIR` checks a checkpoint directory; one that is not a checkpoint is CK201.
    assert_refused(cli("validate", str(tmp_path)), 1, "CK201")
    # A directory where the manifest file should be is CK901.
    assert_refused(cli("validate", str(tmp_path), "--checkpoint", str(tmp_path)), 2, "CK901")
    with pytest.raises(CkptspecError) as exc:
        codec.read_bytes(tmp_path)
    assert exc.value.code == "CK901"


def test_cli_missing_file(cli, tmp_path):
    assert_refused(cli("validate", str(tmp_path / "nope.json")), 2, "CK901")


def test_cli_unreadable_file(cli, tmp_path):
    # Tests run as root, which reads any file whatever its mode: make the path itself unusable.
    parent = write(tmp_path, "not-a-dir", EXAMPLE_TEXT)
    assert_refused(cli("validate", str(parent / "manifest.json")), 2, "CK901")


def test_cli_over_the_cap(cli, tmp_path):
    path = write(tmp_path, "m.json", EXAMPLE_TEXT)
    assert len(EXAMPLE_TEXT) > 1024
    assert_refused(cli("validate", "--max-size", "1K", str(path)), 2, "CK902")
    assert_refused(cli("validate", "--max-size", "1023", str(path)), 2, "CK902")
    assert cli("validate", "--max-size", "1M", str(path)).returncode == 0
    assert cli("validate", "--max-size", str(len(EXAMPLE_TEXT.encode())), str(path)).returncode == 0


def test_cap_applies_before_opening(tmp_path, monkeypatch):
    """read_bytes decides on the size from stat() alone: open() is never called for a big file."""
    path = tmp_path / "big.json"
    with open(path, "wb") as fh:
        fh.truncate(10 * 1024**2)

    def no_open(*args, **kwargs):
        raise AssertionError("the file was opened")

    monkeypatch.setattr(codec, "open", no_open, raising=False)
    with pytest.raises(CkptspecError) as exc:
        codec.read_bytes(path, max_bytes=1024)
    assert exc.value.code == "CK902"


@pytest.mark.parametrize("size", ["0", "-1", "abc", "nan", "1X", ""])
def test_cli_bad_max_size_is_a_usage_error(cli, size):
    result = cli("validate", "--max-size", size, str(EXAMPLE))
    assert result.returncode == 2
    assert "CK999" not in result.stderr
    assert "--max-size" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["validate"],
        ["validate", "--format", "xml", "x.json"],
        ["nosuchcommand"],
        ["validate", "--encoding", "yaml", "x.json"],
        ["schema", "--version"],
    ],
)
def test_cli_usage_errors(cli, args):
    result = cli(*args)
    assert result.returncode == 2
    assert "CK999" not in result.stderr


def test_cli_unknown_schema_version(cli):
    result = cli("schema", "--version", "9.9")
    assert result.returncode == 2 and result.stderr.startswith("CK905 "), result.stderr


# --------------------------------------------------------------------------- the installed command


def test_installed_command_on_bad_files(tmp_path):
    """The console script itself (its own process and stack): no traceback, right codes."""
    cases = [
        ("l.json", b"\xff", 2, "CK903"),
        ("d.json", b"[" * 100_000, 2, "CK903"),
        ("dup.json", b'{"a": 1, "a": 2}', 1, "CK904"),
    ]
    for name, data, exit_code, code in cases:
        assert_refused(run_cli("validate", str(write(tmp_path, name, data))), exit_code, code)
    assert_refused(run_cli("validate", str(tmp_path / "missing.json")), 2, "CK901")


def test_cli_sparse_3gb_refused_without_reading(tmp_path):
    """A 3 GB sparse file is refused from its size alone, within a 1 GB memory limit (reading it would not fit)."""
    path = tmp_path / "huge.json"
    with open(path, "wb") as fh:
        fh.truncate(3 * 1024**3)

    def limit_memory():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (1024**3, 1024**3))

    result = run_cli("validate", "--max-size", "1K", str(path), preexec_fn=limit_memory)
    assert_refused(result, 2, "CK902")
    assert "3221225472 bytes" in result.stderr
    # The default cap (512M) refuses it too.
    assert_refused(run_cli("validate", str(path), preexec_fn=limit_memory), 2, "CK902")


# --------------------------------------------------------------------------- regressions
# Bugs found by this suite, now fixed.


@pytest.mark.parametrize("size", ["inf", "1e400"])
def test_bug_max_size_infinity(cli, size):
    result = cli("validate", "--max-size", size, str(EXAMPLE))
    assert result.returncode == 2 and "CK999" not in result.stderr


def test_bug_cap_on_files_without_a_size(cli):
    result = cli("validate", "--max-size", "1K", "/dev/zero")
    assert "CK902" in result.stderr


def _nested_manifest(depth: int, encoding: str) -> bytes:
    doc = copy.deepcopy(BASE)
    doc["groups"].insert(0, "PLACEHOLDER")
    if encoding == "json":
        return json.dumps(doc).replace('"PLACEHOLDER"', "[" * depth + "]" * depth).encode()
    return msgpack.packb(doc).replace(msgpack.packb("PLACEHOLDER"), b"\x91" * depth + b"\x90", 1)


def test_bug_msgpack_nesting_just_under_the_decoder_limit(cli, tmp_path):
    path = write(tmp_path, "deep.msgpack", _nested_manifest(1000, "msgpack"))
    result = cli("validate", str(path))
    assert "CK999" not in result.stderr and result.returncode in (1, 2)


def test_bug_lone_surrogate_in_decoded_data():
    doc = manifest_with(groups__0__params__0__name="emb\ud800")
    assert "CK002" not in {f.code for f in validate_document(doc).findings}


def test_bug_lone_surrogate_key_in_an_unknown_field():
    """Was: UnicodeEncodeError from validate_document. The models keep a newer minor's unknown
    fields as they are, and could not serialize a dict key holding a lone surrogate."""
    doc = manifest_with(format_version="1.2.0")  # a minor newer than this reader's 1.1
    doc["layout"]["future"] = {"\ud800": None}
    findings = validate_document(doc).findings
    assert [(f.code, f.path) for f in findings if f.severity == "error"] == [("CK001", "$.layout.future['\\ud800']")]


def test_lone_surrogate_escape_refused_by_the_loader(cli, tmp_path):
    text = EXAMPLE_TEXT.replace('"emb.weight"', '"emb\\ud800"', 1)
    assert_refused(cli("validate", str(write(tmp_path, "s.json", text))), 2, "CK903")
    # A proper surrogate pair is one character and fine.
    text = EXAMPLE_TEXT.replace('"tiny test model"', '"tiny \\ud83d\\ude00 model"', 1)
    assert cli("validate", str(write(tmp_path, "ok.json", text))).returncode == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("format_version", "1.0.0\n"),
        ("producer__created", "2026-11-29T20:43:00Z\n"),
        ("files__0__hash", {"algorithm": "sha256", "digest": "0" * 64 + "\n"}),
    ],
)
def test_trailing_newline_in_patterned_string(field, value):
    """ECMA-262 '$' (JSON Schema) does not match before a final newline; Python's does."""
    codes = [f.code for f in validate_document(manifest_with(**{field: value})).findings]
    assert codes == ["CK001"]


def test_bug_superscript_digit_in_version():
    codes = [f.code for f in validate_document(manifest_with(format_version="1.\u00b2.0")).findings]
    assert codes == ["CK001"]


def test_bug_ck116_finding_explosion():
    doc = copy.deepcopy(BASE)
    doc["groups"] = [
        {
            "optimizer_group": 0,
            "partitioning": "flat",
            "partition_count": 20_000,
            "alignment": 1,
            "padded_numel": 0,
            "partition_numel": 0,
            "saved_numels": [0],
            "params": [],
        }
    ]
    assert len(validate_document(doc).findings) < 1_000


# --------------------------------------------------------------------------- fuzz: decode + validate


def _decode_and_validate(data: bytes, encoding: str):
    try:
        doc = codec.decode(data, encoding, "<fuzz>")
    except CkptspecError as exc:
        assert exc.code in {"CK903", "CK904"}, exc.code
        return None
    report = validate_document(doc)
    assert isinstance(report, Report)
    assert "CK002" not in {f.code for f in report.findings}, ([f.to_line() for f in report.findings], data[:200])
    return report


@FUZZ
@given(st.binary(max_size=512), st.sampled_from(["json", "msgpack"]))
def test_fuzz_random_bytes(data, encoding):
    _decode_and_validate(data, encoding)
    codec.encoding_for("x", data)


# Any text, lone surrogates included (once a bug, see test_bug_lone_surrogate_in_decoded_data):
# every code point, and surrogates often enough to matter.
TEXT = st.text(st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=20)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(TEXT, children, max_size=5),
    max_leaves=30,
)


@FUZZ
@given(JSON_VALUES)
def test_fuzz_random_values(value):
    """Any decoded value, given to validate_document directly and through both decoders."""
    report = validate_document(value)  # the library API takes any value, NaN included
    assert isinstance(report, Report)
    assert "CK002" not in {f.code for f in report.findings}
    try:
        text = json.dumps(value, allow_nan=False)
    except ValueError:
        pass
    else:
        _decode_and_validate(text.encode("utf-8"), "json")
    try:
        packed = msgpack.packb(value)
    except (OverflowError, ValueError, TypeError):
        return
    _decode_and_validate(packed, "msgpack")


# --------------------------------------------------------------------------- fuzz: mutated manifests


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


INTERESTING_INTS = st.sampled_from(
    [0, 1, 2, 3, 4, 799, 800, 1599, 1600, 2**20, 2**20 + 1, 2**31, 2**63 - 1, 2**63, -1, -(2**63)]
)
MUTATION_VALUES = (
    JSON_VALUES
    | INTERESTING_INTS
    | st.sampled_from(
        [
            "flat",
            "per_param",
            "float32",
            "bfloat16",
            "module",
            "fragments",
            "emb.weight",
            "head.weight",
            "l1.bias",
            "1.0.0",
            "1.1.0",
            "2.0.0",
            "0.9.0",
            "../x",
            "/abs",
            "C:x",
            "a//b",
            3.0,
            -0.0,
            1e30,
            [],
            {},
            [0],
            [0, 8],
        ]
    )
)


@st.composite
def mutated_manifests(draw):
    doc = copy.deepcopy(BASE)
    if draw(st.booleans()):
        doc["format_version"] = draw(st.sampled_from(["1.0.0", "1.0.7", "1.3.0"]))  # 1.3: unknown keys allowed
    for _ in range(draw(st.integers(1, 6))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        node = _get(doc, path)
        parent = _get(doc, path[:-1]) if path else None
        kind = draw(st.sampled_from(["delete", "replace", "duplicate", "swap", "nudge", "text", "add_key"]))
        if kind == "delete" and path:
            del parent[path[-1]]
        elif kind == "replace" and path:
            parent[path[-1]] = copy.deepcopy(draw(MUTATION_VALUES))  # sampled values are shared objects
        elif kind == "duplicate" and isinstance(node, list) and node:
            i = draw(st.integers(0, len(node) - 1))
            node.insert(draw(st.integers(0, len(node))), copy.deepcopy(node[i]))
        elif kind == "swap" and isinstance(node, list) and len(node) > 1:
            i, j = draw(st.integers(0, len(node) - 1)), draw(st.integers(0, len(node) - 1))
            node[i], node[j] = node[j], node[i]
        elif kind == "nudge" and path and isinstance(node, int) and not isinstance(node, bool):
            parent[path[-1]] = node + draw(st.sampled_from([-1, 1]))
        elif kind == "text" and path and isinstance(node, str):
            parent[path[-1]] = draw(TEXT)
        elif kind == "add_key" and isinstance(node, dict):
            node[draw(TEXT)] = copy.deepcopy(draw(MUTATION_VALUES))
    return doc


@FUZZ
@given(mutated_manifests(), st.sampled_from(["json", "msgpack"]))
def test_fuzz_mutated_manifests(doc, encoding):
    report = validate_document(doc)
    assert isinstance(report, Report)
    codes = {f.code for f in report.findings}
    assert "CK002" not in codes, [f.to_line() for f in report.findings]
    for f in report.findings:  # every finding renders, and as JSON
        f.to_line()
        json.dumps(f.to_dict())
    if report.ok:
        assert report.manifest is not None
        # A valid manifest survives its own serialisation.
        assert validate_document(json.loads(json.dumps(report.manifest.to_dict()))).ok
    # The same document through the decoder (NaN from a mutation is refused there: CK903).
    try:
        data = json.dumps(doc).encode() if encoding == "json" else msgpack.packb(doc)
    except (ValueError, OverflowError, TypeError):
        return
    _decode_and_validate(data, encoding)


# --------------------------------------------------------------------------- an internal error


def _raise_internal(*args, **kwargs):
    raise RuntimeError("boom: a stand-in for a ckptspec bug")


def test_an_internal_error_is_one_ck999_line(monkeypatch, capsys):
    """An exception ckptspec did not anticipate (here injected) is one CK999 line, exit 2, no traceback."""
    monkeypatch.setattr("ckptspec.format.documents.validate_decoded", _raise_internal)  # what validate FILE calls
    monkeypatch.delenv("CKPTSPEC_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["ckptspec", "validate", str(EXAMPLE)])
    with pytest.raises(SystemExit) as exit_info:
        cli_main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "CK999 internal error: RuntimeError: boom: a stand-in for a ckptspec bug "
        "(hint: this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it)"
    ]


def test_ckptspec_debug_shows_the_traceback(monkeypatch):
    """With CKPTSPEC_DEBUG set, the same error propagates (the traceback a bug report needs)."""
    monkeypatch.setattr("ckptspec.format.documents.validate_decoded", _raise_internal)  # what validate FILE calls
    monkeypatch.setenv("CKPTSPEC_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", ["ckptspec", "validate", str(EXAMPLE)])
    with pytest.raises(RuntimeError, match="boom"):
        cli_main()

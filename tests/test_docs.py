"""The documentation is tested like code.

Fenced blocks in docs/*.md and README.md follow these conventions:

* ```` ```json ````: a complete manifest; it must validate without any error.
* ```` ```json fragment ````: part of a manifest; it must parse.
  With ``at=JSONPATH`` (docs/errors.md), it is also applied to
  examples/manifests/zero2-bf16-2ranks.json, or with ``example=1.1`` to its format 1.1
  version zero2-bf16-2ranks-1.1.json (the value at JSONPATH is replaced; ``at=$``
  replaces the fragment's top-level keys). Right after it comes its oracle, a
  ```` ```text expect ```` block written by hand from the example's prose: one
  ``CODE PATH [(rank N)] [in FILE]`` line per finding the example must produce. It must
  include the code of the enclosing ``## CKnnn`` heading, and the findings ckptspec
  produces must be exactly these (as a multiset of code, path, rank and file: none
  missing, none extra); any other code in it must be named in the section's prose (a
  cascade the prose explains). After that, a ```` ```text findings ```` block shows
  readers the finding lines ``ckptspec validate`` prints (without ``MANIFEST: ``); it is
  compared line for line only to keep the docs current: it is documentation, not the oracle.
* ```` ```text expect ````: only right after a ```` ```json fragment at=... ```` block.
* ```` ```json report ````: a `validate --format json` report; it must match the report schema.
* ```` ```console ```` (docs/ only): ``$ command`` lines and their output; every command is run with
  bash in a scratch directory (where ``examples/`` and ``tests/`` link to the repository)
  and its combined stdout/stderr must be the lines shown. An expected line that is exactly
  ``...`` matches any number of lines (for output that legitimately varies; keep it rare).
  With ``checkpoint=NAME`` (a MATRIX or PARALLEL name of tests/_harness/scenarios.py), a real DeepSpeed checkpoint
  (``latest``, the tag directory, DeepSpeed's scripts; not the harness's own files) is first
  *copied* to ``./checkpoint/``, so a block may corrupt it. ``checkpoint=committed/NAME`` copies the one committed
  in tests/data (scenarios.COMMITTED) instead: its bytes are the same on every machine, so a block may show hashes
  (a job's bf16 masters differ by an ulp from one CPU to another, and so do the hashes of its files).
* ```` ```python run ```` (docs/ only, optionally ``checkpoint=NAME`` as above): run as ``python -c``
  with this interpreter in such a scratch directory (forked from the fork server, which has imported
  torch and ckptspec once: tests/_harness/forkserver.py); it must exit 0 with nothing on stderr. Make it
  ``assert`` what it claims.
* ```` ```python excerpt=examples/PATH ```` (or any other language, ```` ```js excerpt=... ````):
  consecutive lines of that file (compared after removing their common indentation), and the
  file (or its directory below examples/) must be named in a tests/test_*.py other than this
  one, which runs it. Every other ```` ```python ```` block in docs/ is an error: nothing shown
  goes untested.
* A ``$ `` line in any other block of docs/ is an error too: a concrete command belongs in a
  ```` ```console ```` block; usage synopses (``ckptspec validate MANIFEST ...``) have no ``$ ``.

Besides the blocks: every error code has a ``## CKnnn name`` heading in docs/errors.md, every
such heading is a code that ckptspec really emits, the schemas' ``$comment`` anchors exist, and
every field of the manifest schema has a ``- **`field`**`` bullet in its section of docs/spec.md,
saying REQUIRED exactly when the schema requires it.
"""

from __future__ import annotations

import ast
import copy
import functools
import itertools
import json
import operator
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from ckptspec.findings import CODES
from ckptspec.format.rules import RULES
from ckptspec.format.validate import validate_document

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCHEMA_DIR = ROOT / "schema"
MANIFEST_SCHEMA = SCHEMA_DIR / "manifest-1.1.schema.json"  # the latest: docs/spec.md describes 1.0 and 1.1
REPORT_SCHEMA = SCHEMA_DIR / "report-1.0.schema.json"
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
EXAMPLES = {"1.0": EXAMPLE, "1.1": ROOT / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"}

CODE_RE = re.compile(r"\bCK\d{3}\b")


def doc_files() -> list[Path]:
    files = sorted(DOCS.glob("*.md"))
    readme = ROOT / "README.md"
    if readme.exists():
        files.append(readme)
    return files


# --------------------------------------------------------------------------- markdown parsing


@dataclass
class Block:
    file: Path
    line: int  # 1-based line of the opening fence
    info: str
    text: str
    heading: str  # the nearest ``##`` heading above the block

    @property
    def words(self) -> list[str]:
        return self.info.split()

    @property
    def options(self) -> dict[str, str]:
        """``key=value`` words of the info string."""
        return dict(w.split("=", 1) for w in self.words[1:] if "=" in w)

    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(```+)(.*)$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def parse_blocks(path: Path) -> list[Block]:
    blocks, heading = [], ""
    lines = path.read_text("utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            ticks, info = fence.group(1), fence.group(2).strip()
            body, j = [], i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                body.append(lines[j])
                j += 1
            assert j < len(lines), f"{path}:{i + 1}: unclosed code fence"
            blocks.append(Block(path, i + 1, info, "\n".join(body) + "\n", heading))
            i = j + 1
            continue
        h = HEADING.match(line)
        if h and len(h.group(1)) == 2:
            heading = h.group(2)
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse_blocks(f)]


def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@dataclass
class Section:
    anchor: str
    level: int
    start: int  # index of the heading line
    end: int  # index one past the section's last line


def sections(path: Path) -> dict[str, Section]:
    """Anchor -> section; explicit ``<a id="x"></a>`` anchors belong to the next heading."""
    lines = path.read_text("utf-8").splitlines()
    headings, pending, in_fence = [], [], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        pending += re.findall(r'<a id="([^"]+)"></a>', line)
        h = HEADING.match(line)
        if h:
            headings.append((i, len(h.group(1)), [slug(h.group(2))] + pending))
            pending = []
    out: dict[str, Section] = {}
    for k, (i, level, anchors) in enumerate(headings):
        end = next((j for j, lv, _ in headings[k + 1 :] if lv <= level), len(lines))
        for anchor in dict.fromkeys(anchors):
            assert anchor not in out, f"{path}: anchor #{anchor} defined twice"
            out[anchor] = Section(anchor, level, i, end)
    return out


# --------------------------------------------------------------------------- JSON blocks


def json_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.words and b.words[0] == "json"]


@pytest.mark.parametrize("block", json_blocks(), ids=lambda b: b.where())
def test_json_block(block: Block):
    try:
        value = json.loads(block.text)
    except json.JSONDecodeError as exc:
        pytest.fail(f"{block.where()}: does not parse: {exc}")
    kind = block.words[1] if len(block.words) > 1 else "manifest"
    if kind == "manifest":
        report = validate_document(value)
        errors = [f.to_line() for f in report.findings if f.severity == "error"]
        assert report.ok and not errors, f"{block.where()}: a complete manifest must be valid:\n" + "\n".join(errors)
    elif kind == "report":
        jsonschema.validate(value, json.loads(REPORT_SCHEMA.read_text("utf-8")))
    else:
        assert kind == "fragment", f"{block.where()}: unknown json block kind {kind!r}"


def test_docs_have_complete_examples():
    """The spec shows at least one complete manifest of each partitioning."""
    full = [json.loads(b.text) for b in json_blocks() if b.words == ["json"] and b.file.name == "spec.md"]
    kinds = {g["partitioning"] for doc in full for g in doc["groups"]}
    assert kinds == {"flat", "per_param"}


# --------------------------------------------------------------------------- errors.md examples

PATH_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def apply_at(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    if path == "$":
        assert isinstance(value, dict), "at=$ takes an object of top-level keys"
        doc.update(value)
        return doc
    assert path.startswith("$"), path
    tokens = PATH_TOKEN.findall(path[1:])
    assert "".join(f".{a}" if a else f"[{b}]" for a, b in tokens) == path[1:], f"cannot parse path {path}"
    keys = [a if a else int(b) for a, b in tokens]
    target = doc
    for key in keys[:-1]:
        target = target[key]
    if isinstance(keys[-1], str):
        assert keys[-1] in target, f"{path} does not exist in the example"
    target[keys[-1]] = value
    return doc


def is_example(block: Block) -> bool:
    """A ```json fragment at=JSONPATH block: an example applied to the example manifest."""
    return block.words[:2] == ["json", "fragment"] and any(w.startswith("at=") for w in block.words)


def is_expectation(block: Block) -> bool:
    return block.words == ["text", "expect"]


@dataclass
class ErrorExample:
    fragment: Block
    expect: Block | None  # the block right after the fragment, if it is a ```text expect: the oracle
    findings: Block | None  # the block after that, if it is a ```text findings: what ckptspec prints

    @property
    def code(self) -> str:
        return self.fragment.heading.split()[0]

    def where(self) -> str:
        return self.fragment.where()


def error_examples(blocks: list[Block] | None = None) -> list[ErrorExample]:
    blocks = parse_blocks(DOCS / "errors.md") if blocks is None else blocks
    out = []
    for i, b in enumerate(blocks):
        if is_example(b):
            expect = blocks[i + 1] if i + 1 < len(blocks) and is_expectation(blocks[i + 1]) else None
            k = i + 2 if expect is not None else i + 1
            findings = blocks[k] if k < len(blocks) and blocks[k].words == ["text", "findings"] else None
            out.append(ErrorExample(b, expect, findings))
    return out


def example_findings(fragment: Block) -> list:
    """The findings of the example manifest with the fragment applied."""
    path = next(w[3:] for w in fragment.words if w.startswith("at="))
    example = EXAMPLES[fragment.options.get("example", "1.0")]
    doc = apply_at(json.loads(example.read_text("utf-8")), path, json.loads(fragment.text))
    return validate_document(doc).findings


# One finding as an expectation writes it: code, JSON path, then its rank and file when it has them.
EXPECT_LINE = re.compile(r"^(CK\d{3}) (\$\S*)(?: \(rank (\d+)\))?(?: in (\S+))?$")
Expected = tuple[str, str, "int | None", "str | None"]  # code, path, rank, file


def parse_expectation(block: Block) -> list[Expected]:
    out = []
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        m = EXPECT_LINE.match(line)
        assert m, f"{block.file.relative_to(ROOT)}:{n}: not a `CODE PATH [(rank N)] [in FILE]` line: {line!r}"
        out.append((m.group(1), m.group(2), None if m.group(3) is None else int(m.group(3)), m.group(4)))
    assert out, f"{block.where()}: an empty expectation (an example must produce its code)"
    return out


def _expected_line(item: Expected) -> str:
    code, path, rank, file = item
    return f"{code} {path}" + ("" if rank is None else f" (rank {rank})") + ("" if file is None else f" in {file}")


def check_expectation(example: ErrorExample) -> None:
    """The oracle: the example's findings are exactly the hand-written expectation."""
    assert example.expect is not None, f"{example.where()}: a ```text expect block must follow the example"
    expected = parse_expectation(example.expect)
    assert example.code in {item[0] for item in expected}, (
        f"{example.expect.where()}: the expectation must include {example.code}, the code the example shows"
    )
    actual = [(f.code, f.path, f.rank, f.file) for f in example_findings(example.fragment)]
    missing = list((Counter(expected) - Counter(actual)).elements())
    extra = list((Counter(actual) - Counter(expected)).elements())
    assert not missing and not extra, (
        f"{example.expect.where()}: ckptspec's findings differ from the expectation"
        + "".join(f"\n  missing:    {_expected_line(i)}" for i in missing)
        + "".join(f"\n  unexpected: {_expected_line(i)}" for i in extra)
    )


@pytest.mark.parametrize("example", error_examples(), ids=lambda e: e.where())
def test_error_example(example: ErrorExample):
    check_expectation(example)


@pytest.mark.parametrize("example", error_examples(), ids=lambda e: e.where())
def test_error_example_printed_findings_are_current(example: ErrorExample):
    """The ```text findings block is documentation (what ckptspec prints), kept current; not the oracle."""
    assert example.findings is not None, (
        f"{example.where()}: a ```text findings block must follow the example's ```text expect block"
    )
    lines = [f.to_line() for f in example_findings(example.fragment)]
    assert lines == example.findings.text.splitlines(), (
        f"{example.findings.where()}: the findings shown are not what ckptspec prints now:\n" + "\n".join(lines)
    )


def test_every_example_has_one_expectation():
    """Every example is followed by exactly one expectation, and no expectation stands alone."""
    problems = []
    for path in doc_files():
        blocks = parse_blocks(path)
        for i, b in enumerate(blocks):
            if is_example(b) and not (i + 1 < len(blocks) and is_expectation(blocks[i + 1])):
                problems.append(f"{b.where()}: the example is not followed by a ```text expect block")
            if is_expectation(b) and not (i > 0 and is_example(blocks[i - 1])):
                problems.append(
                    f"{b.where()}: a ```text expect block that does not follow a ```json fragment at=... block"
                )
            if is_example(b) and path.name != "errors.md":
                problems.append(f"{b.where()}: examples applied to the example manifest belong in docs/errors.md")
    assert not problems, "\n".join(problems)


def test_expectations_name_known_codes():
    known = set(CODES)
    documented = set(error_headings())
    for example in error_examples():
        assert example.expect is not None, f"{example.where()}: no ```text expect block"
        for code, *_ in parse_expectation(example.expect):
            assert code in known and code in documented, f"{example.expect.where()}: {code} is not a known code"


def _section_prose(code: str) -> str:
    """The text of the ``## CODE`` section of docs/errors.md, without its fenced blocks."""
    text = (DOCS / "errors.md").read_text("utf-8")
    m = re.search(rf"^## {code}\b.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no ## {code} section"
    return re.sub(r"^```.*?^```", "", m.group(0), flags=re.S | re.M)


def test_cascades_are_named_in_prose():
    """A finding of another code than the section's is a cascade, which the prose must explain."""
    unexplained = []
    for example in error_examples():
        assert example.expect is not None, f"{example.where()}: no ```text expect block"
        prose = _section_prose(example.code)
        for code in sorted({c for c, *_ in parse_expectation(example.expect)} - {example.code}):
            if not re.search(rf"\b{code}\b", prose):
                unexplained.append(
                    f"{example.expect.where()}: {code} is expected but the {example.code} prose never names it"
                )
    assert not unexplained, "\n".join(unexplained)


# The oracle must notice what a pasted snapshot cannot: the audited CK106 example (l2 reshaped
# to [7, 33] without a word, so its findings also held CK107 and CK108), a missing finding, a
# wrong rank or file, and an expectation that does not show its own code.
_OLD_CK106 = """[
  {"name": "emb.weight", "shape": [50, 16], "numel": 800, "dtype": "bfloat16", "offset": 0, "padding": 0},
  {"name": "l1.bias", "shape": [33], "numel": 33, "dtype": "bfloat16", "offset": 1328, "padding": 0},
  {"name": "l1.weight", "shape": [33, 16], "numel": 528, "dtype": "bfloat16", "offset": 800, "padding": 0},
  {"name": "l2.weight", "shape": [7, 33], "numel": 231, "dtype": "bfloat16", "offset": 1361, "padding": 0},
  {"name": "l2.bias", "shape": [7], "numel": 7, "dtype": "bfloat16", "offset": 1592, "padding": 0}
]
"""
_CK106_OFFSETS = "".join(f"CK106 $.groups[0].params[{k}].offset\n" for k in (1, 2, 3))
_RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize(
    "heading,at,fragment,expect,complaint",
    [
        (
            "CK106 group-offsets",
            "$.groups[0].params",
            _OLD_CK106,
            _CK106_OFFSETS,
            "unexpected: CK107 $.groups[0].padded_numel",
        ),
        (
            "CK106 group-offsets",
            "$.groups[0].params",
            _OLD_CK106,
            _CK106_OFFSETS,
            "unexpected: CK108 $.groups[0].saved_numels[1] (rank 1)",
        ),
        (
            "CK119 locator-file-bounds",
            "$.files[2].size",
            "12000\n",
            "CK119 $.files[2].partitions[0] (rank 1)\n",
            "missing:    CK119 $.files[2].partitions[0] (rank 1)\n",
        ),
        (
            "CK119 locator-file-bounds",
            "$.files[2].size",
            "12000\n",
            f"CK119 $.files[2].partitions[0] (rank 0) in {_RANK1}\n",
            "missing:    CK119",
        ),
        (
            "CK117 locator-numel",
            "$.files[2].size",
            "12000\n",
            f"CK119 $.files[2].partitions[0] (rank 1) in {_RANK1}\n",
            "must include CK117",
        ),
        (
            "CK113 unsafe-path",
            "$.files[0].path",
            '"../x.pt"\n',
            "CK113 $.files[0].path\nCK113 $.files[0].path\n",
            "missing:    CK113 $.files[0].path",
        ),
        (
            "CK113 unsafe-path",
            "$.files[0].path",
            '"../x.pt"\n',
            "CK113 $.files[0].path (rank 0)\n",
            "missing:    CK113 $.files[0].path (rank 0)",
        ),
        ("CK113 unsafe-path", "$.files[0].path", '"../x.pt"\n', "CK113 files[0].path\n", "not a `CODE PATH"),
    ],
)
def test_expectation_catches_a_wrong_example(heading, at, fragment, expect, complaint):
    example = ErrorExample(
        Block(DOCS / "made-up.md", 1, f"json fragment at={at}", fragment, heading),
        Block(DOCS / "made-up.md", 10, "text expect", expect, heading),
        None,
    )
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        check_expectation(example)


def test_every_rule_has_an_example():
    shown = {e.code for e in error_examples()}
    assert {r.code for r in RULES} <= shown


def test_corpus_pointers_exist():
    """Every tests/conformance path named in the docs exists."""
    missing = []
    for path in doc_files():
        for ref in re.findall(r"tests/conformance/[\w./-]+\.(?:json|msgpack)", path.read_text("utf-8")):
            if not (ROOT / ref).exists():
                missing.append(f"{path.name}: {ref}")
    assert not missing, "\n".join(missing)


# --------------------------------------------------------------------------- console and python blocks


@functools.cache  # parsed once: a doc edited during the run must not change what the fixtures run
def console_blocks() -> list[Block]:
    """The console sessions of docs/ (README's are illustrations, not transcripts)."""
    return [b for f in sorted(DOCS.glob("*.md")) for b in parse_blocks(f) if b.words[:1] == ["console"]]


@functools.cache
def python_run_blocks() -> list[Block]:
    return [b for f in sorted(DOCS.glob("*.md")) for b in parse_blocks(f) if b.words[:2] == ["python", "run"]]


def parse_console(block: Block) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"{block.where()}: output before the first '$ ' command"
            steps[-1][1].append(line)
    return steps


def _normalize(text: str) -> str:
    text = re.sub(r'"tool_version": "[^"]*"', '"tool_version": "*"', text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _lines_match(expected: list[str], actual: list[str]) -> bool:
    """Line by line equality, where an expected ``...`` line matches any number of lines."""
    reach = [True] + [False] * len(actual)  # reach[j]: actual[:j] is matched by the expected lines so far
    for line in expected:
        if line == "...":
            reach = list(itertools.accumulate(reach, operator.or_))
        else:
            reach = [False] + [reach[j] and actual[j] == line for j in range(len(actual))]
    return reach[-1]


def test_lines_match():
    assert _lines_match(["a", "...", "d"], ["a", "b", "c", "d"])
    assert _lines_match(["a", "...", "b"], ["a", "b"])
    assert _lines_match(["..."], [])
    assert not _lines_match(["a", "...", "d"], ["a", "b", "c"])
    assert not _lines_match(["a", "b"], ["a", "x", "b"])
    assert not _lines_match(["a"], ["a", "b"])


FORKCLIENT = [sys.executable, "-S", "-I", str(ROOT / "tests" / "_harness" / "forkclient.py")]


@pytest.fixture(scope="module")
def console_env(tmp_path_factory, cli_server):
    """PATH with a `ckptspec` and a `python` that run this interpreter. `ckptspec` is served by a
    fork server (tests/_harness/forkserver.py): 140 commands no longer pay the interpreter start
    and the imports each; every command still runs in a process of its own."""
    bindir = tmp_path_factory.mktemp("bin")
    env = {k: v for k, v in os.environ.items() if k != "CKPTSPEC_DEBUG"}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["LC_ALL"] = "C.UTF-8"
    env["PYTHONIOENCODING"] = "utf-8"
    env["DS_ACCELERATOR"] = "cpu"
    client = shlex.join(FORKCLIENT)
    for name, command in (("ckptspec", client), ("python", f'"{sys.executable}"')):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {**env, "CKPTSPEC_FORKSERVER": str(cli_server)}


def _console_script(block: Block) -> str:
    script = ["__s=0"]
    for i, (command, _) in enumerate(parse_console(block)):
        # The marker goes to stdout; `(exit $__s)` restores $? for a following `echo $?`.
        script += [f"printf '\\n@@@ {i} @@@\\n'", "(exit $__s)", f"{{ {command} ; }} 2>&1", "__s=$?"]
    return "\n".join(script)


# What the harness (tests/_harness/job/train.py, cache.py) adds to a DeepSpeed save directory;
# a doc's reader never has these.
HARNESS_FILES = (
    "harness.json",
    "live_fp32.pt",
    "job.log",
    "task.json",
    "ckptspec-modules.json",
    "saved_manifest.*",
    "load_back.*",
    "parallel.json",  # a PARALLEL job's oracles and extra outputs
    "oracle.rank*.pt",
    "consolidated.pt",
    "eval.pt",
    "universal.log",
    "*_universal",
)


@pytest.fixture(scope="module")
def doc_checkpoints(ds) -> dict[str, Path]:
    """MATRIX (or PARALLEL) name -> cached real DeepSpeed save directory, for every checkpoint= the docs name."""
    blocks = console_blocks() + python_run_blocks()
    names = sorted({b.options["checkpoint"] for b in blocks if "checkpoint" in b.options})
    if not names:
        return {}
    from _harness.scenarios import COMMITTED, MATRIX, PARALLEL

    committed = {n: COMMITTED[n.removeprefix("committed/")] for n in names if n.removeprefix("committed/") in COMMITTED}
    built = [n for n in names if not n.startswith("committed/")]
    unknown = [n for n in names if n not in committed and n not in MATRIX and n not in PARALLEL]
    assert not unknown, f"checkpoint= names that scenarios.py MATRIX, PARALLEL and COMMITTED lack: {unknown}"
    return {**committed, **{name: ds.path(name) for name in built}}


def _scratch(tmp_path_factory, block: Block, checkpoints: dict[str, Path]) -> Path:
    scratch = tmp_path_factory.mktemp("doc")
    for name in ("examples", "tests"):
        (scratch / name).symlink_to(ROOT / name, target_is_directory=True)
    if "checkpoint" in block.options:
        # A copy, not a link: a block may corrupt its checkpoint.
        shutil.copytree(
            checkpoints[block.options["checkpoint"]],
            scratch / "checkpoint",
            ignore=shutil.ignore_patterns(*HARNESS_FILES),
        )
    return scratch


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory, console_env, doc_checkpoints) -> dict[str, tuple[int, str, str]]:
    """Every console and `python run` block, run concurrently, each in its own scratch directory:
    where -> (exit code, stdout, stderr)."""
    procs = {}
    for block in console_blocks() + python_run_blocks():
        cwd = _scratch(tmp_path_factory, block, doc_checkpoints)
        argv = (
            ["bash", "-c", _console_script(block)]
            if block.words[0] == "console"
            else [*FORKCLIENT, "--python-c", block.text]  # `python -c TEXT`, forked from the server (torch imported)
        )
        procs[block.where()] = subprocess.Popen(
            argv, cwd=cwd, env=console_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for where, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        out[where] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("block", console_blocks(), ids=lambda b: b.where())
def test_console_block(block: Block, doc_runs):
    """The transcripts are current: each command prints what the page shows. This keeps the docs
    honest about ckptspec's output; it is not evidence that the output is right (see
    test_console_codes_on_the_corpus_are_the_corpus_codes and the oracle tests)."""
    _, stdout, stderr = doc_runs[block.where()]
    assert stderr == "", stderr
    chunks = re.split(r"\n?@@@ (\d+) @@@\n", stdout)[1:]
    outputs = {int(chunks[k]): chunks[k + 1] for k in range(0, len(chunks), 2)}
    for i, (command, expected) in enumerate(parse_console(block)):
        actual = _normalize(outputs.get(i, ""))
        assert _lines_match(_normalize("\n".join(expected)).splitlines(), actual.splitlines()), (
            f"{block.where()}: `$ {command}` printed:\n{outputs.get(i, '')}"
        )


CORPUS_COMMAND = re.compile(r"^ckptspec validate (tests/conformance/1\.0/(?:valid|invalid)/\S+\.(?:json|msgpack))$")


def test_console_codes_on_the_corpus_are_the_corpus_codes():
    """Where a transcript validates a conformance file, the codes it shows are the ones the
    corpus generator expects (tests/conformance/1.0/expected.json, written independently of
    ckptspec), so a pasted transcript cannot show a wrong verdict."""
    expected = json.loads((ROOT / "tests/conformance/1.0/expected.json").read_text("utf-8"))
    checked = 0
    for block in console_blocks():
        for command, output in parse_console(block):
            match = CORPUS_COMMAND.match(command)
            if not match:
                continue
            key = match.group(1).removeprefix("tests/conformance/1.0/")
            key = key.replace(".msgpack", ".json") if key not in expected else key
            shown = set(re.findall(r"\b(CK\d{3})\b", "\n".join(output)))
            want = set(expected[key]["codes"]) | set(expected[key]["warnings"])
            assert shown == want, (
                f"{block.where()}: `$ {command}` shows {sorted(shown)}, the corpus expects {sorted(want)}"
            )
            checked += 1
    assert checked >= 5, "the docs no longer show validations of corpus files"


@pytest.mark.parametrize("block", python_run_blocks(), ids=lambda b: b.where())
def test_python_run_block(block: Block, doc_runs):
    code, stdout, stderr = doc_runs[block.where()]
    assert code == 0 and stderr == "", f"{block.where()}: exit {code}\n{stdout}{stderr}"


def python_blocks() -> list[Block]:
    return [b for f in sorted(DOCS.glob("*.md")) for b in parse_blocks(f) if b.words[:1] == ["python"]]


def excerpt_blocks() -> list[Block]:
    """Blocks of any language shown as an excerpt of an example (```js excerpt=examples/...)."""
    return [b for f in sorted(DOCS.glob("*.md")) for b in parse_blocks(f) if "excerpt" in b.options]


# Example programs an excerpt may come from, and the test that runs each end to end and checks
# its result (not a mention: the test must exist).
EXAMPLE_RUNNERS = {
    "examples/hf_gpt2": "tests/interop/test_examples.py::test_hf_gpt2_runs_and_loads_bit_exact",
    "examples/node-reader": "tests/interop/test_node_reader.py::test_node_reader_matches_ckptspec_reconstruct",
}


def _test_exists(node_id: str) -> bool:
    module, name = node_id.split("::")
    tree = ast.parse((ROOT / module).read_text("utf-8"))
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.where())
def test_python_block_is_run(block: Block):
    """A python block is run here (`python run`) or is an excerpt of an example a test runs."""
    if block.words[1:2] == ["run"]:
        return  # test_python_run_block runs it
    assert "excerpt" in block.options and len(block.words) == 2, (
        f"{block.where()}: a ```python block must be `python run [checkpoint=NAME]` or `python excerpt=examples/PATH`"
    )
    check_excerpt(block)


@pytest.mark.parametrize("block", excerpt_blocks(), ids=lambda b: b.where())
def test_excerpt_block(block: Block):
    check_excerpt(block)


def check_excerpt(block: Block):
    """The block is consecutive lines (less their common indentation) of an example that a test runs."""
    source = block.options["excerpt"]
    path = ROOT / source
    assert source.startswith("examples/") and path.is_file(), f"{block.where()}: {source} is not a file in examples/"
    runner = EXAMPLE_RUNNERS.get(str(Path(source).parent))
    assert runner is not None, f"{block.where()}: no test in EXAMPLE_RUNNERS runs {source}, so nothing runs it"
    assert _test_exists(runner), f"{block.where()}: {runner}, which runs {source}, does not exist"
    lines, want = path.read_text("utf-8").splitlines(), block.text.splitlines()
    windows = ("\n".join(lines[i : i + len(want)]) + "\n" for i in range(len(lines) - len(want) + 1))
    assert any(textwrap.dedent(w) == block.text for w in windows), f"{block.where()}: not an excerpt of {source}"


@pytest.mark.parametrize(
    "info,text,complaint",
    [
        ("python", "print(1)\n", "must be `python run"),
        ("python excerpt=examples/hf_gpt2/train.py", "engine = None\n", "not an excerpt of"),
        ("python excerpt=examples/demo.py", "import argparse\n", "so nothing runs it"),
        ("python excerpt=tests/conftest.py", "import os\n", "not a file in examples/"),
    ],
)
def test_untested_python_blocks_are_refused(info: str, text: str, complaint: str):
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        test_python_block_is_run(Block(DOCS / "made-up.md", 1, info, text, ""))


def test_commands_only_in_console_blocks():
    """A `$ command` outside a console block would be shown but never run."""
    stray = [
        f"{b.where()}: {line}"
        for f in sorted(DOCS.glob("*.md"))
        for b in parse_blocks(f)
        if b.words[:1] != ["console"]
        for line in b.text.splitlines()
        if line.startswith("$ ")
    ]
    assert not stray, "\n".join(stray)


# --------------------------------------------------------------------------- error codes


def error_headings() -> dict[str, str]:
    """``## CK105 alias-shape`` -> {"CK105": "alias-shape"}."""
    out = {}
    for line in (DOCS / "errors.md").read_text("utf-8").splitlines():
        m = re.match(r"^## (CK\d{3})(?:\s+(\S+))?\s*$", line)
        if m:
            assert m.group(1) not in out, f"two headings for {m.group(1)}"
            out[m.group(1)] = m.group(2) or ""
        else:
            assert not re.match(r"^#+ CK\d", line), f"malformed code heading: {line!r}"
    return out


def codes_in_source() -> set[str]:
    """Codes the modules use (findings.py, the table of every code, left out)."""
    modules = [p for p in (ROOT / "ckptspec").rglob("*.py") if p.name != "findings.py"]
    return {c for path in modules for c in CODE_RE.findall(path.read_text("utf-8"))}


def test_every_code_has_a_heading():
    headings = error_headings()
    required = list(CODES)
    missing = [c for c in required if c not in headings]
    assert not missing, f"docs/errors.md lacks a '## CODE name' heading for {missing}"


def test_rule_headings_name_the_rule():
    headings = error_headings()
    wrong = {code: (headings.get(code), name) for code, name in CODES.items() if headings.get(code) != name}
    assert not wrong, f"heading name differs from the rule name (heading, rule): {wrong}"


def test_every_heading_is_a_real_code():
    fake = sorted(set(error_headings()) - codes_in_source())
    assert not fake, f"docs/errors.md documents codes that ckptspec never emits: {fake}"


# Code families docs/errors.md covers: every code ckptspec emits in them needs a heading.
DOCUMENTED_FAMILIES = ("CK0", "CK1", "CK2", "CK3", "CK4", "CK5", "CK6", "CK9")


def test_every_emitted_code_is_documented():
    emitted = {c for c in codes_in_source() if c.startswith(DOCUMENTED_FAMILIES)}
    undocumented = sorted(emitted - set(error_headings()))
    assert not undocumented, f"ckptspec emits codes that docs/errors.md does not document: {undocumented}"


def test_error_codes_in_order():
    codes = list(error_headings())
    assert codes == sorted(codes)


# --------------------------------------------------------------------------- schema <-> spec


def _comments(node, found: list[str]) -> list[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$comment" and isinstance(value, str):
                found.append(value)
            else:
                _comments(value, found)
    elif isinstance(node, list):
        for value in node:
            _comments(value, found)
    return found


@pytest.mark.parametrize("schema_file", sorted(SCHEMA_DIR.glob("*.schema.json")), ids=lambda p: p.name)
def test_schema_comment_anchors_exist(schema_file: Path):
    refs = [
        m
        for c in _comments(json.loads(schema_file.read_text("utf-8")), [])
        for m in re.findall(r"(?:docs/)?([\w-]+\.md)#([\w-]+)", c)
    ]
    assert refs or schema_file.name.startswith("report"), f"{schema_file.name} links no spec section"
    missing = [f"{doc}#{anchor}" for doc, anchor in refs if anchor not in sections(DOCS / doc)]
    assert not missing, f"{schema_file.name} points to anchors that do not exist: {missing}"


def _anchor_of(definition: dict) -> str:
    m = re.search(r"spec\.md#([\w-]+)", definition.get("$comment", ""))
    assert m, f"$def without a spec.md anchor: {definition}"
    return m.group(1)


def schema_objects() -> list[tuple[str, str, dict]]:
    """(label, spec anchor, object schema) for the document and every $def with properties."""
    schema = json.loads(MANIFEST_SCHEMA.read_text("utf-8"))
    out = [("document", "document", schema)]
    out += [(name, _anchor_of(d), d) for name, d in schema["$defs"].items() if "properties" in d]
    return out


BULLET = re.compile(r"^- \*\*`([^`]+)`\*\*")


def spec_bullets(anchor: str) -> dict[str, str]:
    """Field bullets of one spec section: name -> the bullet's text."""
    spec = DOCS / "spec.md"
    section = sections(spec)[anchor]
    lines = spec.read_text("utf-8").splitlines()[section.start : section.end]
    bullets: dict[str, str] = {}
    current = None
    for line in lines:
        m = BULLET.match(line)
        if m:
            current = m.group(1)
            assert current not in bullets, f"spec.md#{anchor}: two bullets for {current}"
            bullets[current] = line
        elif current and (line.startswith("#") or (line and not line.startswith(" "))):
            current = None
        elif current:
            bullets[current] += "\n" + line
    return bullets


@pytest.mark.parametrize("label,anchor,obj", schema_objects(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_schema_field_has_a_bullet(label: str, anchor: str, obj: dict):
    bullets = spec_bullets(anchor)
    fields = obj["properties"]
    missing = [f for f in fields if f not in bullets]
    assert not missing, f"spec.md#{anchor} ({label}) has no '- **`field`**' bullet for {missing}"
    extra = [b for b in bullets if b not in fields]
    assert not extra, f"spec.md#{anchor} ({label}) has bullets for fields the schema lacks: {extra}"
    required = set(obj.get("required", []))
    for name, text in bullets.items():
        said = re.findall(r"This (REQUIRED|OPTIONAL) property", text)
        assert len(said) == 1, (
            f"spec.md#{anchor}: the bullet for {name} must say 'This REQUIRED/OPTIONAL property' once"
        )
        assert (said[0] == "REQUIRED") == (name in required), (
            f"spec.md#{anchor}: {name} is {said[0]} in the spec but "
            f"{'required' if name in required else 'optional'} in the schema"
        )


def test_every_field_bullet_has_a_type():
    for _, anchor, _ in schema_objects():
        for name, text in spec_bullets(anchor).items():
            assert re.match(r"^- \*\*`[^`]+`\*\* \*[^*]+\*$", text.splitlines()[0]), (
                f"spec.md#{anchor}: the bullet for {name} must be '- **`{name}`** *type*'"
            )


def test_spec_dtype_table_matches_schema_and_rules():
    from ckptspec.format.dtypes import ITEMSIZE

    schema = json.loads(MANIFEST_SCHEMA.read_text("utf-8"))
    text = (DOCS / "spec.md").read_text("utf-8")
    table = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", text, re.M)}
    assert table == ITEMSIZE
    assert sorted(table) == sorted(schema["$defs"]["dtype"]["enum"])


# --------------------------------------------------------------------------- links


def test_relative_links_resolve():
    """Links to files exist; links to #anchors (here or in another .md) exist."""
    broken = []
    for path in doc_files():
        text = path.read_text("utf-8")
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # not inside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in sections(dest):
                broken.append(f"{path.name}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)

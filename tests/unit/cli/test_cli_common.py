"""What the commands share behaves the same in every command: sizes, unreadable files.

Every SIZE option refuses what is not a positive byte count as a usage error (exit 2),
never CK999; a .pt file that cannot be read is CK205 with one hint, whichever command reads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec.checkpoint.states import DAMAGED_HINT
from ckptspec.cli import cli
from ckptspec.cli._common import SizeParam

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "manifests" / "zero2-bf16-2ranks.json")


@pytest.mark.parametrize(
    "text,size",
    [
        ("512M", 512 * 2**20),
        ("2G", 2 * 2**30),
        ("5GB", 5 * 2**30),
        ("1KiB", 1024),
        ("1048576", 2**20),
        (" 1.5k ", 1536),
    ],
)
def test_sizes(text, size):
    assert SizeParam().convert(text, None, None) == size


@pytest.mark.parametrize("option", ["--max-size", "--max-shard-size"])
@pytest.mark.parametrize("bad", ["1e400", "inf", "-1", "0", "abc", ""])
def test_a_bad_size_is_a_usage_error(option, bad, tmp_path):
    args = ["validate", EXAMPLE] if option == "--max-size" else ["reconstruct", str(tmp_path), str(tmp_path / "out")]
    result = CliRunner().invoke(cli, [*args, option, bad])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "CK999" not in result.output


def test_an_unreadable_file_is_ck205_with_one_hint(tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 not a zip archive")
    for command in (["generate", str(tmp_path)], ["validate", str(tmp_path)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1, result.output
        assert "CK205" in result.output and f"(hint: {DAMAGED_HINT})" in result.output, result.output

"""#37 (L11): `reconstruct CK CK/<tag>` wrote model.safetensors beside the shards, and `validate` went on
saying valid. The output is refused inside the tag directory it reads (CK906, nothing written); a
reconstruction's output found there is named by `validate` (CK226, a warning: DeepSpeed reads none of
these names; the fault suite has the cases). The save directory above the tag stays a place to write."""

from __future__ import annotations

import json
import shutil

import pytest
from _harness.faults import snapshot, tag_dir
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.errors import CkptspecError
from ckptspec.export.api import reconstruct


def _run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


@pytest.mark.parametrize("base", ["committed:s2-bf16-ws2", "pp2-s1-fp32-ws2"])
def test_reconstruct_into_its_own_tag_directory_is_refused(base, ds, tmp_path):
    source = COMMITTED["s2-bf16-ws2"] if base.startswith("committed:") else ds.path(base)
    ck = tmp_path / "CK"
    shutil.copytree(source, ck)
    tag = tag_dir(ck)
    before = snapshot(tmp_path)
    for out in (tag, tag / "weights"):
        result = _run("reconstruct", ck, out)
        assert result.exit_code == 2, result.output
        assert f"{out}: CK906 the output is inside the checkpoint's own tag directory" in result.output
        with pytest.raises(CkptspecError, match="CK906"):
            reconstruct(ck, out)
    assert snapshot(tmp_path) == before, "nothing is written"

    assert _run("reconstruct", ck, ck, "-q").exit_code == 0  # beside `latest`: not in the checkpoint
    assert (ck / "model.safetensors").is_file()
    checked = _run("validate", ck, "--format", "json")
    assert checked.exit_code == 0 and json.loads(checked.stdout)["findings"] == []

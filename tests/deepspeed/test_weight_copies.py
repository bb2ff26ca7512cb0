"""CK235 for every kind (#39, item 5): the rounding it compares with is torch's, and the checkpoints the
copy faults (tests/_harness/faults_copies.py) start from and take their files from are valid untouched, so
the finding each fault gets is the copy's alone. The faults themselves run in test_shards.py."""

import json
import struct

import pytest
import torch
from _harness.faults import FAULTS  # noqa: F401  (first: faults_copies builds on it)
from _harness.faults_copies import COPIES_FAULTS, COPIES_INDEX_FAULTS
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.deepspeed.check.domain.weights import ROUND

# Ties, subnormals, the largest finite values and past them, signed zeros, infinities and NaN.
EDGES = [
    0.0, -0.0, 1.0, -1.5, 1.0 + 2**-8, 1.0 + 2**-9, 1.0 + 3 * 2**-9, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0,
    65519.0, 65520.0, 1e6, -1e6, 2**-24, 2**-25, 3 * 2**-26, 1e-40, -1e-45, 3.3895314e38, float("inf"),
    float("-inf"), float("nan"),
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rounding_is_torchs(dtype):
    """The bytes CK235 expects are the bytes torch's cast gives (DeepSpeed's copy_ of a master), on the
    edges and on a million random words."""
    gen = torch.Generator().manual_seed(7)
    words = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    values = torch.cat([torch.tensor(EDGES, dtype=torch.float32), words.view(torch.float32)])
    want = values.to(getattr(torch, dtype)).numpy().tobytes() if dtype != "bfloat16" else None
    if want is None:
        want = values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    got = ROUND[dtype](values.numpy().tobytes())
    if got != want:  # NaN payloads: torch keeps the sign and quiets; compare as numbers there
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
        bad = [
            i
            for i in range(len(values))
            if got[i * itemsize : (i + 1) * itemsize] != want[i * itemsize : (i + 1) * itemsize]
        ]
        assert all(torch.isnan(values[i]) for i in bad), [(values[i].item(), i) for i in bad[:5]]
    assert struct.unpack("<2H", ROUND["bfloat16"](struct.pack("<2f", 1.0, -2.0))) == (0x3F80, 0xC000)


@pytest.mark.parametrize(
    "name",
    sorted(
        {f.base for f in COPIES_FAULTS + COPIES_INDEX_FAULTS} | {f.donor for f in COPIES_FAULTS + COPIES_INDEX_FAULTS}
    ),
)
def test_bases_and_donors_are_valid_untouched(name, ds):
    """Every checkpoint a copy fault starts from or copies from validates without a finding (no hashes):
    the rule holds on DeepSpeed's own saves of every kind and dtype."""
    result = CliRunner().invoke(cli, ["validate", str(ds.path(name)), "--no-hash", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["findings"] == []

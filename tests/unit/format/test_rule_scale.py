"""A rule's findings grow with what a manifest locates, not with the counts it claims.

A manifest that claims a million ranks (the schema's maximum partition_count) but locates two
must give one CK124 finding naming the range of ranks, not a million lines (which also took
half a minute to produce).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ckptspec.format.validate import validate_document

VALID = Path(__file__).parents[2] / "conformance" / "1.1" / "valid" / "stage2-bf16-ws2-complete.json"
BASE = json.loads(VALID.read_text())  # one group; ranks 0 and 1 each locate exp_avg and exp_avg_sq


def _ck124(doc: dict) -> list[str]:
    return [f.message for f in validate_document(doc, build_model=False).findings if f.code == "CK124"]


@pytest.mark.parametrize("claimed", [3, 6, 2**20])
def test_ranks_claimed_but_not_located_are_one_finding(claimed):
    doc = copy.deepcopy(BASE)
    doc["groups"][0]["partition_count"] = claimed
    last = claimed - 1
    who = "rank 2 has" if last == 2 else f"ranks 2-{last} have"
    assert _ck124(doc) == [f"{who} no partition of state(s) 'exp_avg', 'exp_avg_sq' of group 0, which other ranks have"]


def test_a_gap_and_a_partial_rank_are_told_apart():
    doc = copy.deepcopy(BASE)
    doc["groups"][0]["partition_count"] = 5
    moved = doc["files"][2]["state_partitions"]
    moved[1]["rank"] = 3  # rank 1 keeps exp_avg only; rank 3 holds exp_avg_sq only; ranks 2 and 4 nothing
    assert _ck124(doc) == [
        "rank 1 has no partition of state(s) 'exp_avg_sq' of group 0, which other ranks have",
        "rank 2 has no partition of state(s) 'exp_avg', 'exp_avg_sq' of group 0, which other ranks have",
        "rank 3 has no partition of state(s) 'exp_avg' of group 0, which other ranks have",
        "rank 4 has no partition of state(s) 'exp_avg', 'exp_avg_sq' of group 0, which other ranks have",
    ]

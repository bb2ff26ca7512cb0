"""``tasks.launched`` runs a kind of ``LAUNCHED_SCRIPTS`` with its own script (resume_job.py: the validated resume),
and keys its entries with that script and the modules it imports, which job/main.py's kinds never run: an edit to
them rebuilds those entries only. No job is started (the keys only)."""

from __future__ import annotations

import pytest
from _harness import cache, tasks
from _harness.launch import BEFORE_LOAD, JOB_MAIN, RESUME_MAIN


@pytest.fixture
def scripts(tmp_path, monkeypatch):
    copies = []
    for script in tasks.LAUNCHED_SCRIPTS["validated_resume"]:
        copy = tmp_path / script.name
        copy.write_text(script.read_text())
        copies.append(copy)
    monkeypatch.setitem(tasks.LAUNCHED_SCRIPTS, "validated_resume", tuple(copies))
    monkeypatch.setattr(cache, "versions", lambda: {"deepspeed": "0", "torch": "0"})  # none installed here
    return copies


def test_the_validated_resume_runs_its_own_script_with_what_it_imports():
    assert tasks.LAUNCHED_SCRIPTS["validated_resume"] == (RESUME_MAIN, BEFORE_LOAD)
    assert "from _harness.before_load import" in RESUME_MAIN.read_text()
    assert "validated_resume" not in JOB_MAIN.read_text()  # not a kind of job/main.py


@pytest.mark.parametrize("edited", [0, 1], ids=["resume_job", "before_load"])
def test_an_edit_to_its_script_rekeys_its_entries_only(scripts, edited):
    own = {"kind": "validated_resume", "args": {"load": "/x", "scenarios": []}}
    other = {"kind": "resume", "args": {"spec": {}, "load": "/x"}}
    keys = tasks._launched_key(own, 2), tasks._launched_key(other, 2)
    scripts[edited].write_text(scripts[edited].read_text() + "\n# edited\n")
    assert tasks._launched_key(own, 2) != keys[0]
    assert tasks._launched_key(other, 2) == keys[1]

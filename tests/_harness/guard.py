"""The ``deepspeed`` marker cannot be forgotten: a test that reaches DeepSpeed without it fails.

The plugin (plugin.py) arms the guard for a pytest run and names the test running now (its setup,
call and teardown: a module- or session-scoped fixture runs in the setup of the first test that
uses it, whose fixtures include it). Where the harness hands out something of DeepSpeed's (a job's
result, built or cached: ``tasks.path``, ``tasks.cached``, ``tasks.launched``; a launch of ranks
that import DeepSpeed: ``launch.run_launches``, ``launch.run_torchrun``; DeepSpeed run in the test
process: ``oracles.zero_to_fp32``) it calls ``reached``, which raises unless that test carries the marker,
which only a fixture puts on it (``ds``, ``ds_checkpoint``, ``zero_to_fp32``, or a fixture that uses
one of them). Reached while no test runs (at collection) is refused as well: collection may read
scenario names, never a job's result. Outside pytest (benchmarks, examples/demo.py) nothing is
checked.

This module imports nothing of pytest's, torch's or DeepSpeed's: tasks.py and oracles.py import it.
"""

from __future__ import annotations

MARKER = "deepspeed"
FIXTURES = "`ds_checkpoint` (or `ds`, or `zero_to_fp32` for the oracle)"

armed = False  # set by the plugin for a pytest run
current = None  # the pytest item whose setup, call or teardown runs now, if any
refused: list[str] = []  # what ``reached`` refused a test since the last ``take``, even if it was caught


class UnmarkedDeepSpeedUse(AssertionError):
    """A test reached DeepSpeed without the ``deepspeed`` marker."""


def reached(what: str) -> None:
    """Refuse ``what`` (a job's result, or DeepSpeed in this process) unless the running test is marked."""
    if not armed:
        return
    if current is None:
        message = f"{what} reached while no test runs (at collection?): only a test's fixtures may reach it"
    elif current.get_closest_marker(MARKER) is None:
        message = (
            f"{current.nodeid} reached {what} without the `{MARKER}` marker: take it through a fixture, "
            f"{FIXTURES}, which marks the test (tests/README.md, Fixtures and markers)"
        )
    else:
        return
    if current is not None:
        refused.append(message)
    raise UnmarkedDeepSpeedUse(message)


def take() -> list[str]:
    """What was refused since the last call (the plugin fails the test phase with it)."""
    found = refused[:]
    refused.clear()
    return found

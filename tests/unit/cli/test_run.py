"""``ckptspec.cli.run``, what ``python -m ckptspec`` and the installed command call: ``main`` in a
process that leaves with ``os._exit`` (nothing freed one by one on the way out). Real processes:
the whole output arrives, the exit codes and messages are ``main``'s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "manifests" / "zero2-bf16-2ranks.json"


def _ckptspec(*args: str, code: str = "from ckptspec.cli import run; run()") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, cwd=REPO, timeout=120)


def test_a_long_output_arrives_whole_through_a_pipe():
    done = _ckptspec("schema", "--version", "1.1")
    assert done.returncode == 0
    assert done.stdout == (REPO / "schema" / "manifest-1.1.schema.json").read_bytes()


def test_exit_codes_and_messages_are_mains():
    assert _ckptspec("validate", str(EXAMPLE)).returncode == 0
    missing = _ckptspec("validate", str(REPO / "no-such-manifest.json"))
    assert missing.returncode == 2 and b"CK901" in missing.stderr
    usage = _ckptspec("validate", str(EXAMPLE), "--no-hash")
    assert usage.returncode == 2 and b"--no-hash" in usage.stderr
    text = _ckptspec(code="import sys; from ckptspec import cli; cli.main = lambda: sys.exit('bye'); cli.run()")
    assert (text.returncode, text.stderr) == (1, b"bye\n")


def test_exit_handlers_still_run():
    code = "import atexit; from ckptspec.cli import run; atexit.register(print, 'handled'); run()"
    done = _ckptspec("--version", code=code)
    assert done.returncode == 0 and done.stdout.endswith(b"handled\n")


def test_python_m_ckptspec_runs_it():
    assert (REPO / "ckptspec" / "__main__.py").read_text().strip().endswith("run()")
    done = subprocess.run([sys.executable, "-m", "ckptspec", "--version"], capture_output=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and b"ckptspec" in done.stdout


# Marks the decoded checkpoint's end: "freed" on stderr when the command's StateCache (the first
# one made: the tag directory's pickles, read early) is freed.
_WATCH_THE_STATES = (
    "import sys, weakref\n"
    "from ckptspec.checkpoint import states\n"
    "made = states.StateCache.__init__\n"
    "def watched(self):\n"
    "    made(self)\n"
    "    if states.StateCache.__init__ is watched:\n"
    "        weakref.finalize(self, print, 'freed', file=sys.stderr, flush=True).atexit = False\n"
    "        states.StateCache.__init__ = made\n"
    "states.StateCache.__init__ = watched\n"
)


def test_what_a_command_made_is_left_to_the_end_of_the_process(tmp_path):
    """Under ``run``, generate's and validate's decoded pickles and manifest are never freed one by
    one (the process ends first); a caller of ``main`` gets them freed as usual."""
    from _harness.scenarios import COMMITTED

    checkpoint = str(COMMITTED["s2-bf16-ws2"])
    for args in (["generate", checkpoint, "-o", str(tmp_path / "m.json")], ["validate", checkpoint, "--no-hash"]):
        kept = _ckptspec(*args, code=_WATCH_THE_STATES + "from ckptspec.cli import run; run()")
        freed = _ckptspec(*args, code=_WATCH_THE_STATES + "from ckptspec.cli import main; main()")
        assert kept.returncode == freed.returncode == 0, (kept.stderr, freed.stderr)
        assert kept.stdout == freed.stdout
        assert b"freed" not in kept.stderr and b"freed" in freed.stderr
    assert (tmp_path / "m.json").stat().st_size > 1000

#!/usr/bin/env bash
# Run the tests.
#   ./scripts/test.sh            everything: first mypy and the unit tier (tests/unit) in .venv-unit, which has
#                                no torch, DeepSpeed or transformers (so the tier is proven to need none),
#                                then the rest, real DeepSpeed checkpoints included, in .venv
#   ./scripts/test.sh --unit     mypy over the package, then the unit tier (the inner loop: no DeepSpeed job,
#                                about 26 s on 2 cores)
#   ./scripts/test.sh ARGS...    pytest ARGS in .venv (paths, -k, -m ...): any test, the unit tier's included
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
# Python keeps compiled modules: the tests start the CLI and DeepSpeed ranks as new processes hundreds
# of times, and a shell that sets PYTHONDONTWRITEBYTECODE would make each compile ckptspec again
# (measured: unit tier 30-34 s with it set, 26 s without). The job cache ignores __pycache__.
unset PYTHONDONTWRITEBYTECODE
unit() {
    bash scripts/env-unit.sh
    # The package's types first (pyproject.toml [tool.mypy]; a few seconds with its cache, .mypy_cache):
    # in .venv-unit, where torch and DeepSpeed are not installed and not followed either way.
    .venv-unit/bin/python -m mypy
    # No module-scoped DeepSpeed fixtures here: tests spread one by one over the two workers.
    .venv-unit/bin/python -m pytest -n 2 --dist load tests/unit "$@"
}
if [ "${1:-}" = "--unit" ]; then
    shift
    unit "$@"
    exit
fi
bash scripts/env.sh
if [ $# -eq 0 ]; then
    # The real-DeepSpeed job results the cache lacks (a cold cache: ~3.5 min of launches) build in the
    # background while the unit tier's environment, mypy and the unit tier run; a test that needs one
    # waits for the build (tests/_harness/prebuild.py). If the unit tier fails, the build still ends
    # (what it publishes, the next run uses).
    .venv/bin/python tests/_harness/prebuild.py >.venv/prebuild.log 2>&1 &
    unit -q
    # Two workers, whole files each: module-scoped real-DeepSpeed fixtures stay on one worker.
    exec .venv/bin/python -m pytest -n 2 --dist loadfile --ignore=tests/unit
fi
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"

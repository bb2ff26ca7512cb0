#!/usr/bin/env bash
# Run the whole test suite (real DeepSpeed checkpoints included) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export DS_ACCELERATOR=cpu
# Two workers, whole files each: module-scoped real-DeepSpeed fixtures stay on one worker.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"

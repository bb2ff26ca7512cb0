#!/usr/bin/env bash
# Run the whole test suite (real DeepSpeed checkpoints included) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest "$@"

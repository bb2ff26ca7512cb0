#!/usr/bin/env bash
# The main job on an embedded default: make a real DeepSpeed checkpoint,
# describe it, validate it, and show corrupted copies being refused.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export DS_ACCELERATOR=cpu
exec .venv/bin/python examples/demo.py "$@"

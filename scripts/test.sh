#!/usr/bin/env bash
# Run the whole test suite (real DeepSpeed checkpoints included) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# DeepSpeed 0.15 (the older-DeepSpeed tests) needs numactl for ZeRO-3 on CPU.
if ! command -v numactl >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq numactl; } >/dev/null 2>&1 \
        || { echo "numactl is missing and could not be installed (apt-get install numactl)" >&2; exit 2; }
fi
export DS_ACCELERATOR=cpu
# Two workers, whole files each: module-scoped real-DeepSpeed fixtures stay on one worker.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"

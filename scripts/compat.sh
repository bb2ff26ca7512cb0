#!/usr/bin/env bash
# The compatibility tier (opt-in): rebuild the checkpoints of an older DeepSpeed (0.15.4) in their
# own virtualenv (.venv-ds015) and check them, and the committed copies the default run reads
# (tests/data/deepspeed-0.15.4/), against what that DeepSpeed writes now.
#   ./scripts/compat.sh            check
#   ./scripts/compat.sh --refresh  rewrite tests/data/deepspeed-0.15.4/ first
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# DeepSpeed 0.15 needs numactl for ZeRO-3 on CPU.
if ! command -v numactl >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq numactl; } >/dev/null 2>&1 \
        || { echo "numactl is missing and could not be installed (apt-get install numactl)" >&2; exit 2; }
fi
export DS_ACCELERATOR=cpu
if [ "${1:-}" = "--refresh" ]; then
    shift
    PYTHONPATH=tests .venv/bin/python -m _harness.compat --refresh
fi
exec .venv/bin/python -m pytest -m compat tests/deepspeed/test_deepspeed_015.py "$@"

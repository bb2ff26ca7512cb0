#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at .venv with everything the demo
# and the tests need. torch==2.13.0 is installed first: it is a CPU wheel that
# lies on this machine's disk; asking for plain `torch` would download a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.ckptspec-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -m pip install -q -e ".[deepspeed,test]" 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -c "import torch, deepspeed, ckptspec" 2>/dev/null \
        || { echo "environment setup failed" >&2; exit 2; }
    touch "$stamp"
fi

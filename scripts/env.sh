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
log=".venv/install.log"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setting up .venv (log: $log) ..." >&2
    {
        .venv/bin/python -m pip install --upgrade pip &&
        .venv/bin/python -m pip install "torch==2.13.0" &&
        .venv/bin/python -m pip install -e ".[deepspeed,reconstruct,test]" &&
        .venv/bin/python -c "import torch, deepspeed, ckptspec"
    } >"$log" 2>&1 || { tail -30 "$log" >&2; echo "environment setup failed; see $log" >&2; exit 2; }
    touch "$stamp"
fi

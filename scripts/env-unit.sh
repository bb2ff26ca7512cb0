#!/usr/bin/env bash
# Create (or reuse) .venv-unit: ckptspec with the unit tier's test tools and NO torch, DeepSpeed or
# transformers, so that `./scripts/test.sh --unit` proves tests/unit needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-unit/bin/python ]; then
    "$PYTHON" -m venv .venv-unit
fi
stamp=".venv-unit/.ckptspec-installed"
log=".venv-unit/install.log"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setting up .venv-unit (log: $log) ..." >&2
    {
        .venv-unit/bin/python -m pip install --upgrade pip &&
        .venv-unit/bin/python -m pip install -e ".[reconstruct,test-unit]" &&
        .venv-unit/bin/python -c "
import importlib.util, sys
present = [m for m in ('torch', 'deepspeed', 'transformers', 'safetensors') if importlib.util.find_spec(m)]
sys.exit(f'.venv-unit must not have {present}' if present else 0)"
    } >"$log" 2>&1 || { tail -30 "$log" >&2; echo "unit environment setup failed; see $log" >&2; exit 2; }
    touch "$stamp"
fi

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
        .venv/bin/python -m pip install -e ".[deepspeed,reconstruct,http,s3,test]" &&
        .venv/bin/python -c "import torch, deepspeed, ckptspec"
    } >"$log" 2>&1 || { tail -30 "$log" >&2; echo "environment setup failed; see $log" >&2; exit 2; }
    touch "$stamp"
fi
# nginx (the Debian package) for tests/remote: the tests start it on 127.0.0.1 to serve real
# checkpoints with range requests, and count the bytes it sent from its own access log.
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
    { apt-get update -qq && apt-get install -y -qq nginx; } >/dev/null 2>&1 \
        || { echo "nginx is missing and could not be installed (apt-get install nginx)" >&2; exit 2; }
fi
# The Node.js example reader (examples/node-reader) and its ajv, for the tests that run them:
# `npm ci` from the committed lockfile when node_modules is missing or older than the lockfile.
node_dir="examples/node-reader"
if [ ! -f "$node_dir/node_modules/.package-lock.json" ] || [ "$node_dir/package-lock.json" -nt "$node_dir/node_modules/.package-lock.json" ]; then
    if ! command -v npm >/dev/null; then
        { apt-get update -qq && apt-get install -y -qq nodejs npm; } >/dev/null 2>&1 \
            || { echo "npm is missing and could not be installed (apt-get install nodejs npm)" >&2; exit 2; }
    fi
    echo "installing $node_dir/node_modules (npm ci) ..." >&2
    (cd "$node_dir" && npm ci --no-audit --no-fund) >.venv/npm-install.log 2>&1 \
        || { tail -30 .venv/npm-install.log >&2; echo "npm ci failed; see .venv/npm-install.log" >&2; exit 2; }
fi

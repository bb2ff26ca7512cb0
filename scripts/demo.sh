#!/usr/bin/env bash
# The main job on an embedded default: validate the bundled manifests,
# then show a corrupted copy being refused.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/python -m ckptspec.demo "$@"

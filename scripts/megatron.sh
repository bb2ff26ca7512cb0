#!/usr/bin/env bash
# Megatron-core torch_dist checkpoints (docs/validation.md, "Megatron-core torch_dist checkpoints"): build
# .venv-megatron and run tests/_harness/megatron_job.py (2 ranks, torchrun, CPU, gloo): Megatron-core saves with torch_dist and loads back,
# and the result replaces the committed copy the suite reads, tests/data/megatron-core-0.16.1/ (checkpoint/,
# loaded.pt: what dist_checkpointing.load returned, job.json: the versions and the job script's sha256).
#
#   ./scripts/megatron.sh [OUT]     OUT: write there instead (default: the committed copy)
#   ./scripts/megatron.sh --check   run the job into a temporary directory and tests/dcp/test_megatron.py on it
#                                   (in the project's .venv), the committed copy left as it is
#
# Not part of ./scripts/test.sh: a fresh .venv-megatron costs torch again (~900 MiB) for a small package (measured:
# docs/validation.md, "Megatron-core torch_dist checkpoints").
# megatron-core 0.16.1 is the newest release for this machine's Python 3.11 (0.17.0 and later need >= 3.12, and
# the torch wheel on disk is cp311); it declares torch, numpy and packaging, and its torch_dist writer also needs
# psutil, which it does not declare.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
out="${1:-tests/data/megatron-core-0.16.1}"
venv="${MEGATRON_VENV:-.venv-megatron}"  # another place: MEGATRON_VENV
if [ ! -f "$venv/.installed" ]; then
    echo "setting up $venv (log: $venv/install.log) ..." >&2
    "$PYTHON" -m venv "$venv"
    {
        "$venv/bin/python" -m pip install "torch==2.13.0" &&
        "$venv/bin/python" -m pip install "megatron-core==0.16.1" psutil &&
        "$venv/bin/python" -c "import torch, psutil, megatron.core.dist_checkpointing"
    } >"$venv/install.log" 2>&1 || { tail -30 "$venv/install.log" >&2; echo "setup failed; see $venv/install.log" >&2; exit 2; }
    touch "$venv/.installed"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ "$check" = 0 ] || out="$work/fresh"
port=$((29500 + RANDOM % 1000))
PYTHONWARNINGS=ignore "$venv/bin/torchrun" --nproc_per_node 2 --master-port "$port" \
    tests/_harness/megatron_job.py "$work/out" >"$work/log" 2>&1 || { grep -v "UserWarning\|warnings.warn" "$work/log" | tail -40 >&2; exit 1; }
rm -rf "$out"
mkdir -p "$(dirname "$out")"
cp -r "$work/out" "$out"
echo "$out: $(ls "$out/checkpoint" -A | tr '\n' ' ')" >&2
if [ "$check" = 1 ]; then
    ./scripts/env.sh
    CKPTSPEC_MEGATRON_DATA="$out" PYTHONPATH="$PWD" .venv/bin/python -m pytest -q -p no:cacheprovider \
        tests/dcp/test_megatron.py
fi

#!/usr/bin/env bash
# A torchtitan job resumes from a DeepSpeed checkpoint read in place (examples/torchtitan_resume.py;
# docs/fsdp2.md, "torchtitan"). Not part of ./scripts/test.sh: torchtitan's dependencies (datasets, wandb,
# tensorboard, ...: +576 MiB) pin fsspec<=2026.2.0 where the project's s3fs needs fsspec 2026.9.0, so it
# gets its own environment, .venv-titan: torch==2.13.0 (the CPU wheel on disk, as scripts/env.sh installs
# it), torchtitan==0.3.0 with its dependencies, and this checkout (editable).
#
#   ./scripts/torchtitan-check.sh [SOURCE | ENTRY]
#
# SOURCE: a harness checkpoint of the plain model (default dcp-s2-bf16-ws2-groups): the real DeepSpeed
# job's entry of the test cache (.cache/ds or $CKPTSPEC_DS_CACHE), built by the project's .venv if it is
# missing; or ENTRY, such an entry's directory. Exits 1 if the job holds anything DeepSpeed did not.
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint="${1:-dcp-s2-bf16-ws2-groups}"
PYTHON="${PYTHON:-python3}"
entry="$checkpoint"
[ -d "$entry" ] || { ./scripts/env.sh && entry=$(DS_ACCELERATOR=cpu .venv/bin/python -c '
import sys
sys.path.insert(0, "tests")
from _harness import scenarios, tasks
print(tasks.path(sys.argv[1], scenarios.REGISTRY[sys.argv[1]]))  # this entry alone, built if missing
' "$checkpoint"); }
venv=.venv-titan
if [ ! -f "$venv/.installed" ]; then
    echo "setting up $venv (log: $venv/install.log) ..." >&2
    "$PYTHON" -m venv "$venv"
    {
        "$venv/bin/python" -m pip install "torch==2.13.0" &&
        "$venv/bin/python" -m pip install "torchtitan==0.3.0" &&
        "$venv/bin/python" -m pip install -e . &&
        "$venv/bin/python" -c "import torchtitan.components.checkpointer.dcp, ckptspec"
    } >"$venv/install.log" 2>&1 || { tail -30 "$venv/install.log" >&2; echo "setup failed; see $venv/install.log" >&2; exit 2; }
    touch "$venv/.installed"
fi
port=$((29500 + RANDOM % 1000))
PYTHONPATH="$PWD" PYTHONWARNINGS=ignore "$venv/bin/torchrun" --nproc_per_node 2 --master-port "$port" \
    examples/torchtitan_resume.py "$entry" 2> >(grep -v "^W.*torch/distributed/run.py\|register_pre_backward_hook" >&2)

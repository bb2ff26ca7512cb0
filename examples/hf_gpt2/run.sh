#!/usr/bin/env bash
# Train, save with ckptspec, validate, reconstruct, load with transformers: bash examples/hf_gpt2/run.sh OUT
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR}
here=$(dirname "$0")
mkdir -p "$out"

# DeepSpeed is chatty: its log goes to a file, shown only if training fails.
DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 "$here/train.py" --out "$out" > "$out/train.log" 2>&1 \
  || { tail -n 40 "$out/train.log"; exit 1; }
grep '^saved ' "$out/train.log"
ckptspec validate "$out/checkpoint"
ckptspec reconstruct -q "$out/checkpoint" "$out/hf"
cp "$out/config.json" "$out/hf/"
python "$here/load.py" "$out/hf" "$out/reference.safetensors"

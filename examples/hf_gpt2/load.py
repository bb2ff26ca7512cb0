"""Load the reconstructed weights with `from_pretrained` and check them against the live engine.

    python examples/hf_gpt2/load.py OUT/hf OUT/reference.safetensors

OUT/hf holds model.safetensors (from `ckptspec reconstruct`) and config.json. ckptspec stores
the tied lm_head.weight once, under its owner transformer.wte.weight (the tie is in the
file's `ckptspec.aliases` metadata); transformers re-ties it from the config, as for its own files.
Exits 1 if any weight or logit differs.
"""

import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
from transformers.utils import logging


def main(hf_dir: str, reference_file: str) -> int:
    torch.set_num_threads(1)  # as train.py computed the reference logits
    logging.disable_progress_bar()
    model, info = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        print(f"{hf_dir}: loading reported {info}")
        return 1
    with safe_open(f"{hf_dir}/model.safetensors", framework="pt") as f:
        aliases = json.loads(f.metadata()["ckptspec.aliases"])
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie was not restored"

    reference = load_file(reference_file)
    masters = {name.removeprefix("master."): t for name, t in reference.items() if name.startswith("master.")}
    state = model.state_dict()
    differ = [
        name for name, t in masters.items() if not torch.equal(state[name].view(torch.int32), t.view(torch.int32))
    ]
    for alias, owner in aliases.items():  # the tied names hold their owner's values too
        if not torch.equal(state[alias], state[owner]):
            differ.append(alias)
    with torch.no_grad():
        logits = model(reference["probe"]).logits
    if differ or not torch.equal(logits, reference["logits"]):
        print(f"{hf_dir}: differs from the live engine: {differ or 'logits'}")
        return 1
    print(
        f"{hf_dir}: {len(state)} tensors bit-identical to the live engine's fp32 masters "
        f"(aliases {aliases}); logits equal"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

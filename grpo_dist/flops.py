"""Model FLOPs utilisation (MFU) and tokens/s of the training passes, for the step metrics.

Model FLOPs of one step, summed over ranks (the work the model needs, not what the kernels happen to run: padding
and recomputation, activation checkpointing's included, are not counted):

    F = 6 N T_train  +  2 N (T_reference + T_old)  +  A (3 I + P)

    N        the parameters in matrix products: every parameter, less the input embedding's unless the LM head is
             tied to it (the lookup is no product; a tied head's product is)
    T_pass   the tokens the pass computed, padding excluded (tokens/useful_<pass> - tokens/shared_<pass>: what
             share_prompts did not compute again is not counted); T_train counts every iteration (num_iterations)
    6 N      forward (2 N per token: a multiply and an add per weight) plus backward (4 N: gradients of the inputs
             and of the weights); a no-grad pass (reference, old policy) is the forward only, 2 N
    A        the attention products of one forward over the trained rows: per layer, Q K^T and (softmax) V cost
             2 x 2 x d_q FLOPs for every causal (query, key) pair, s (s + 1) / 2 pairs in a row of s tokens:
             A = 2 d_q L sum_rows s (s + 1), with d_q = heads x head_dim, L layers, s = prompt + completion tokens
             of the row (a shared prompt counted in every row that reads it)
    I, P     training iterations (num_iterations: forward + backward, 3 A each) and no-grad passes (P = the
             reference pass when beta > 0 and the KL is in the loss, plus the old-policy pass when I > 1: A each)

    mfu = F / (step_time_s x peak_flops x ranks)      (and mfu_update, mfu_logprobs over each stage's time)

peak_flops is the dense bf16 peak of one device: the config key `peak_flops` when set, else looked up by the CUDA
device's name (PEAK_BF16 below), else unknown: the mfu metrics are then null (a CPU, an unlisted GPU).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per device (vendor data sheets, without sparsity), by a substring of the CUDA name.
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("A100", 312e12),
             ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12), ("B200", 2250e12))


def matmul_params(model: torch.nn.Module) -> int:
    """N above: the parameters that enter a matrix product per token."""
    total = sum(p.numel() for p in model.parameters())
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    if embed is None:
        return total
    head = get_out() if callable(get_out) else None
    tied = head is not None and head.weight is embed.weight
    return total if tied else total - embed.weight.numel()


def attention_dims(hf_config) -> tuple[int, int]:
    """(L, d_q): layers, and query width (heads x head dim) of a Hugging Face decoder config."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, heads * head_dim


def peak_flops(configured: float | None, device: torch.device) -> float | None:
    """The dense bf16 peak of one device: configured, else the table's for this CUDA device, else None."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def step_flops(n: int, layers: int, d_q: int, tokens: dict, pair_sum: float,
               iterations: int) -> tuple[float, float]:
    """(update FLOPs, no-grad FLOPs) of one step by the module docstring's formula. tokens: the step metrics'
    tokens/useful_<pass> and tokens/shared_<pass>; pair_sum: sum over the trained rows of s (s + 1). P counts the
    no-grad passes that ran (computed tokens > 0)."""
    def computed(name: str) -> float:
        return tokens.get(f"tokens/useful_{name}", 0.0) - tokens.get(f"tokens/shared_{name}", 0.0)
    no_grad_passes = sum(computed(name) > 0 for name in ("reference", "old"))
    attention = 2.0 * d_q * layers * pair_sum
    update = 6.0 * n * computed("train") + 3.0 * attention * iterations
    no_grad = 2.0 * n * (computed("reference") + computed("old")) + attention * no_grad_passes
    return update, no_grad


def metrics(update_flops: float, no_grad_flops: float, tokens: dict, times: dict, peak: float | None,
            ranks: int) -> dict:
    """mfu, mfu_update, mfu_logprobs (null without a peak) and tokens_per_s_update / tokens_per_s_logprobs (all
    ranks' computed tokens over this rank's stage time)."""
    def rate(x: float, t: float) -> float:
        return x / t if t > 0 else 0.0

    def mfu(flops: float, t: float) -> float | None:
        return rate(flops, t) / (peak * ranks) if peak else None
    train = tokens.get("tokens/useful_train", 0.0) - tokens.get("tokens/shared_train", 0.0)
    no_grad = sum(tokens.get(f"tokens/useful_{p}", 0.0) - tokens.get(f"tokens/shared_{p}", 0.0)
                  for p in ("reference", "old"))
    t_update, t_logprobs, t_step = times.get("update", 0.0), times.get("logprobs", 0.0), times.get("step", 0.0)
    return {"mfu": mfu(update_flops + no_grad_flops, t_step), "mfu_update": mfu(update_flops, t_update),
            "mfu_logprobs": mfu(no_grad_flops, t_logprobs) if no_grad else None,
            "tokens_per_s_update": rate(train, t_update), "tokens_per_s_logprobs": rate(no_grad, t_logprobs),
            "model_flops": update_flops + no_grad_flops}

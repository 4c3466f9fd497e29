"""Warnings at start for settings that are allowed but are probably not what the user meant, one line each, with
the overrides that give the published settings. Printed by rank 0 (train.py) and by `python -m grpo_dist.config
--check` (on stderr; the exit code stays 0)."""

from __future__ import annotations

# GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio, a sequence-mean loss and
# clip ranges of 3e-4 / 4e-4 (the length-normalised sequence ratio stays within ~1e-3 of 1; token-level GRPO's 0.2
# clips almost nothing there)
GSPO_OVERRIDES = ("loss_type=seq_mean_token_mean", "epsilon=3e-4", "epsilon_high=4e-4")
GSPO_TOKEN_LEVEL_EPSILON = 0.01  # clip ranges at or above this are token-level GRPO's scale


def start_warnings(cfg) -> list[str]:
    out = []
    if cfg.importance_sampling_level == "sequence":
        token_mean = cfg.loss_type == "token_mean"
        wide = max(cfg.epsilon, cfg.clip_high) >= GSPO_TOKEN_LEVEL_EPSILON
        if token_mean or wide:
            got = ", ".join(([f"loss_type={cfg.loss_type}"] if token_mean else []) +
                            ([f"epsilon={cfg.epsilon:g}", f"epsilon_high={cfg.clip_high:g}"] if wide else []))
            out.append(f"warning: importance_sampling_level=sequence (GSPO) with {got}: the GSPO paper uses a "
                       f"sequence mean and clip ranges 3e-4 / 4e-4: {' '.join(GSPO_OVERRIDES)}")
    return out

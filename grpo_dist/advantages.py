"""Group-relative advantages: each completion's reward compared with the other completions of its prompt.

Pure tensor code, no torch.distributed: the trainer passes the global batch std in when scale_rewards='batch'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo_dist.config.choices import SCALE_REWARDS

# added to the std; rewards [1,1,0,0] then give +-0.8659, as in the GRPO-from-scratch recipe's worked example
ADV_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, num_generations: int | Sequence[int], scale_rewards: str = "group",
                     batch_std: float | torch.Tensor | None = None, eps: float = ADV_EPS) -> torch.Tensor:
    """rewards: [n_prompts * G] laid out group by group -> advantages of the same shape.

    group: (r - mean_g) / (std_g + eps), std unbiased (n - 1), as GRPO and TRL.
    batch: (r - mean_g) / (std_batch + eps), std over the whole batch (all ranks: pass batch_std).
    none:  r - mean_g (Dr. GRPO: no std scaling, which biases towards easy/hard questions otherwise).
    num_generations may be a list of group sizes (group size by difficulty): group g is the next sizes[g] rewards,
    its mean and std over those alone.
    """
    if not isinstance(num_generations, int):
        return _sized_group_advantages(rewards, list(num_generations), scale_rewards, batch_std, eps)
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    # float64 statistics: the squares of rewards above ~1.8e19 overflow float32 (a std of inf would zero every
    # advantage, silently); the result is float32, inf where it does not fit (the non-finite guard names that)
    grouped = rewards.double().view(-1, num_generations)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        std = rewards.double().std() if batch_std is None else torch.as_tensor(batch_std, dtype=torch.float64)
        centred = centred / (std + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return centred.reshape(-1).float()


def _sized_group_advantages(rewards: torch.Tensor, sizes: list[int], scale_rewards: str,
                            batch_std: float | torch.Tensor | None, eps: float) -> torch.Tensor:
    if sum(sizes) != rewards.numel() or any(g < 1 for g in sizes):
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of sizes {sizes}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    r = rewards.double()
    out = []
    for grp in torch.split(r, sizes):  # a few dozen groups a step: a loop is clearer than segment sums
        centred = grp - grp.mean()
        if scale_rewards == "group":
            centred = centred / (grp.std() + eps)
        out.append(centred)
    centred = torch.cat(out) if out else r
    if scale_rewards == "batch":
        std = r.std() if batch_std is None else torch.as_tensor(batch_std, dtype=torch.float64)
        centred = centred / (std + eps)
    return centred.float()


def zero_advantage_groups(rewards: torch.Tensor, num_generations: int | Sequence[int]) -> torch.Tensor:
    """[n_prompts] bool: groups whose completions all got the same reward, so they teach nothing."""
    if not isinstance(num_generations, int):
        return torch.tensor([bool((g == g[0]).all()) for g in torch.split(rewards.float(), list(num_generations))],
                            dtype=torch.bool)
    grouped = rewards.float().view(-1, num_generations)
    return (grouped == grouped[:, :1]).all(dim=1)


def dynamic_sampling_quota(counts: list[int], target: int) -> list[int]:
    """Groups each rank keeps, given how many non-zero-advantage groups each has (`counts`, by rank): in total
    min(target, sum(counts)), dealt round-robin so the ranks stay as even as their counts allow. The same answer
    on every rank."""
    keep = [0] * len(counts)
    left = min(target, sum(counts))
    while left > 0:
        for r in range(len(counts)):
            if left and keep[r] < counts[r]:
                keep[r] += 1
                left -= 1
    return keep

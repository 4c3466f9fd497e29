"""Per-row sampling noise: the uniform numbers a sampled completion draws depend only on which completion it is.

Row (seed, step, prompt, completion) draws its t-th token with the uniform U[row, t] (rollout.sample_from_scores,
inverse CDF), and row_noise builds the rows' U at rollout start from one generator per row, so a completion does
not depend on the batch it is sampled in, on the rank that samples it, on the chunking (generation_batch_size), or
on which other rows are still being decoded (the decoder may drop finished rows: decode_compaction_threshold).

The documented hash of a row, row_seed:
    numpy.random.SeedSequence([seed mod 2**64, stream, step, prompt_index, completion_index]).generate_state(1,
    uint64)[0], which seeds a torch.Generator (CPU) that draws U[row, :] = torch.rand(max_new_tokens).
The four numbers come from the caller: in training, step = the number of global prompt batches the data sampler
drew before this one (PromptSampler.last_batch_number; dynamic sampling's rounds are batches of their own) and
prompt_index = the prompt's place in that global batch (rank r's i-th prompt: r x prompts_per_rank + i), so 1 rank
and 2 ranks with the same global batch draw the same completions; evaluation uses the trainer step and the
example's index in the evaluation set. `stream` keeps training (0) and evaluation (1) apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

TRAIN_STREAM, EVAL_STREAM = 0, 1


def row_seed(seed: int, step: int, prompt_index: int, completion_index: int, stream: int = TRAIN_STREAM) -> int:
    """The 64-bit generator seed of one row (module docstring)."""
    entropy = [int(seed) % 2**64, int(stream), int(step), int(prompt_index), int(completion_index)]
    if min(entropy) < 0:
        raise ValueError(f"row_seed needs non-negative step and indices, got {entropy[1:]}")
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def row_seeds(seed: int, step: int, prompt_indices: Sequence[int], n: int, stream: int = TRAIN_STREAM) -> list[int]:
    """The seeds of len(prompt_indices) x n rows, grouped prompt by prompt (the rollout layout)."""
    return [row_seed(seed, step, p, j, stream) for p in prompt_indices for j in range(n)]


def row_noise(seeds: Sequence[int], length: int, device) -> torch.Tensor:
    """[rows, length] fp32 uniforms in [0, 1), row i from its own generator seeded with seeds[i]; drawn on the CPU
    (the same numbers on every device), then moved (rows x length x 4 bytes: tiny)."""
    out = torch.empty(len(seeds), length, dtype=torch.float32)
    g = torch.Generator()
    for i, s in enumerate(seeds):
        g.manual_seed(s)
        torch.rand(length, generator=g, out=out[i])
    return out.to(device)

"""Decode-batch compaction: rows leave the decoder when they finish (config key decode_compaction_threshold).

Without it the sampling loop (rollout._sample_loop) keeps every row in every decode step until the longest row
ends: with long-tailed completion lengths it computes rows x longest row-steps for the tokens actually generated.
With it, once the finished fraction of the rows still in the decode batch reaches the threshold, the decoder keeps
only the unfinished rows: its KV cache, positions and masks (LeanDecoder.compact, HFDecoder.compact) and the loop's
per-row state (row map, done flags, sampling noise) are indexed down to them.

The batch shrinks to a bucket size, not to the exact count of unfinished rows: a multiple of BUCKET_MULTIPLE (or
the batch itself), the extra places filled with finished rows whose outputs are dropped. Buckets keep the number of
distinct decode shapes small (one CUDA graph each: decoder.CUDAGraphStep) and keep the batched matmuls on the
kernels of the full batch (measured on CPU: fp32 linear layers of 1-3 rows take another kernel than 16 rows and
differ in the last bits; 5+ rows gave the 16-row bits).

Tokens and log-probs do not change: each row's draws come from its own noise (grpo_dist.sampling_noise), and a
row's arithmetic does not depend on the other rows of the batch.
"""

from __future__ import annotations

import math

import torch

BUCKET_MULTIPLE = 8


def bucket_size(alive: int, batch: int) -> int:
    """The decode batch for `alive` unfinished rows out of `batch`: alive rounded up to a multiple of
    BUCKET_MULTIPLE, at most batch."""
    return min(batch, max(1, math.ceil(alive / BUCKET_MULTIPLE)) * BUCKET_MULTIPLE)


def buckets(batch: int) -> list[int]:
    """Every decode batch size compaction can give from a batch of `batch` rows, largest first."""
    return sorted({bucket_size(n, batch) for n in range(1, batch + 1)}, reverse=True)


def keep_rows(done: torch.Tensor, size: int) -> torch.Tensor:
    """Indices (ascending) of the rows to keep: every unfinished row, then finished ones up to `size` rows."""
    alive = (~done).nonzero().squeeze(1)
    fill = done.nonzero().squeeze(1)[:size - len(alive)]
    return torch.cat([alive, fill]).sort().values


def should_compact(done_count: int, rows: int, threshold: float | None) -> int | None:
    """The bucket to compact a decode batch of `rows` rows (done_count of them finished) to, or None: no
    threshold, below it, or no smaller bucket."""
    if threshold is None or done_count < threshold * rows:
        return None
    size = bucket_size(rows - done_count, rows)
    return size if size < rows else None


class ForcedLengths:
    """A decoder wrapper that makes row i end after exactly lengths[i] tokens: EOS banned before, the only token
    allowed at that step (benchmarks and tests of long-tailed lengths, bench/generation.py). Its per-row state
    follows compaction like the decoder's own."""

    def __init__(self, decoder, lengths: torch.Tensor, eos_id: int):
        self.decoder, self.lengths, self.eos_id = decoder, lengths, eos_id

    def prefill(self, ids, mask, repeats, max_new_tokens):
        self.lengths, self.t = self.lengths.to(ids.device), 0
        return self._force(self.decoder.prefill(ids, mask, repeats, max_new_tokens))

    def step(self, tokens):
        self.t += 1
        return self._force(self.decoder.step(tokens))

    def compact(self, keep: torch.Tensor) -> None:
        self.decoder.compact(keep)
        self.lengths = self.lengths[keep]

    def _force(self, logits: torch.Tensor) -> torch.Tensor:
        end = self.lengths - 1 == self.t
        logits = logits.clone()
        logits[:, self.eos_id] = float("-inf")
        logits[end] = float("-inf")
        logits[end, self.eos_id] = 0.0
        return logits

"""Decode-batch compaction: rows leave the decoder when they finish (config key decode_compaction_threshold).

Without it the sampling loop (rollout._sample_loop) keeps every row in every decode step until the longest row
ends: with long-tailed completion lengths it computes rows x longest row-steps for the tokens actually generated.
With it, once the finished fraction of the rows still in the decode batch reaches the threshold (the host looks
every rollout.STOP_CHECK_EVERY steps), the decoder keeps
only the unfinished rows: its KV cache, positions and masks (LeanDecoder.compact, HFDecoder.compact) and the loop's
per-row state (row map, done flags, sampling noise) are indexed down to them.

The batch shrinks to a bucket size, not always to the exact count of unfinished rows, the extra places filled with
finished rows whose outputs are dropped (they are counted as computed: tokens/processed_decode). Two reasons:
- MIN_ROWS: fp32 linear layers of 1-3 rows take another CPU kernel than larger batches and differ from them in the
  last bits (measured, torch 2.13 CPU, SmolLM2's and the tiny model's shapes: 4+ rows give the 64-row bits), so a
  batch never shrinks below 4 rows;
- granularity: from 16 unfinished rows up, the bucket is a multiple of the largest power of two <= alive / 8 (16-31
  rows: even counts, 32-63: multiples of 4, ...), so a bucket wastes under 1/8 of its rows while the number of
  distinct decode shapes (one CUDA graph each: decoder.CUDAGraphSteps) stays about 8 per doubling of the batch.
Both were picked by bench/long_cot.py --quick (decode padding 23.5 % with the former multiples of 8 and threshold
0.25, 8.4 % with these and 0.125; docs/long-completions.md); a compaction copies the kept rows' KV cache once,
which costs about one decode step's attention read.

Tokens and log-probs do not change: each row's draws come from its own noise (grpo_dist.sampling_noise), and a
row's arithmetic does not depend on the other rows of the batch.
"""

from __future__ import annotations

import math

import torch

MIN_ROWS = 4  # the smallest decode batch (fp32 matmuls of 1-3 rows differ in the last bits: see above)


def bucket_size(alive: int, batch: int) -> int:
    """The decode batch for `alive` unfinished rows out of `batch`: at least MIN_ROWS, alive rounded up to a
    multiple of the largest power of two <= alive / 8 (1 below 16 rows), at most batch."""
    step = 1 << max(0, (alive // 8).bit_length() - 1)
    return min(batch, max(MIN_ROWS, math.ceil(alive / step) * step))


def buckets(batch: int) -> list[int]:
    """Every decode batch size compaction can give from a batch of `batch` rows, largest first."""
    return sorted({bucket_size(n, batch) for n in range(1, batch + 1)}, reverse=True)


def keep_rows(done: torch.Tensor, size: int) -> torch.Tensor:
    """Indices (ascending) of the rows to keep: every unfinished row, then finished ones up to `size` rows."""
    # unfinished rows first, then finished ones, each in row order (a stable sort of the flags); no host sync: the
    # count `size` comes from the host already
    return torch.sort(done.to(torch.uint8), stable=True).indices[:size].sort().values


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
        """EOS banned, except in the rows whose last step this is, where it is the only token left: on the device,
        no host sync (a boolean index would make one)."""
        eos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        eos[self.eos_id] = True
        end = (self.lengths - 1 == self.t)[:, None]
        return torch.where(eos, torch.where(end, 0.0, float("-inf")),
                           torch.where(end, float("-inf"), logits)).to(logits.dtype)

"""Difficulty-aware prompt sampling (config section `curriculum`, docs/curriculum.md).

The data sampler (grpo_dist/data/sampler.py) asks a Curriculum for the example indices of each global batch. The
answer is a pure function of (seed, batch number, statistics) and the statistics are updated from all-reduced
counts, so every rank computes the same global batch and takes its own slice of it.

  static  the examples sorted by a difficulty column (ties in a seeded order); batch b draws, without replacement,
          from the easiest ceil(f(b) * N) of them, f(b) = start_fraction + (1 - start_fraction) * min(1, b /
          pacing_steps) (and never fewer than one global batch).
  online  each prompt keeps its visits, its summed pass rate and how many of its last groups in a row were flat
          (all completions correct, or none): teach nothing (the GRPO advantage of a flat group is 0). A prompt
          whose last `window` groups were flat is retired: drawn with weight retire_weight instead of 1. The weight
          is > 0 (config check), so a retired prompt is still drawn now and then and can come back.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from grpo_dist.config import ConfigError, CurriculumConfig
from grpo_dist.data.examples import DataError, PromptExample


def difficulties(examples: list[PromptExample], field: str) -> np.ndarray:
    """[N] float difficulty of each example from its `field` column: a number, or a string ending in one ('Level
    3'). One line naming the key and the first row at fault when a row lacks it or it is not a number."""
    out = np.empty(len(examples), dtype=np.float64)
    for i, ex in enumerate(examples):
        v: Any = ex.columns.get(field)
        if isinstance(v, str):
            m = re.search(r"(-?\d+(?:\.\d+)?)\s*$", v)
            v = float(m.group(1)) if m else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            what = "has no such column" if field not in ex.columns else f"has {ex.columns[field]!r}, not a number"
            raise ConfigError(f"config key 'curriculum.difficulty_field' = {field!r}: training row {ex.index} {what} "
                              f"(curriculum.mode=static orders the prompts by it)")
        out[i] = float(v)
    return out


def _rng(seed: int, *keys: int) -> np.random.Generator:
    s = seed if seed >= 0 else (1 << 64) + seed  # SeedSequence takes non-negative entropy
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([s, *keys])))


class Curriculum:
    """The curriculum's order and statistics; the same object state on every rank."""

    def __init__(self, cfg: CurriculumConfig, examples: list[PromptExample], global_batch: int, seed: int):
        if cfg.mode not in ("static", "online"):
            raise ValueError(f"Curriculum needs mode static or online, got {cfg.mode!r}")
        self.cfg, self.seed, self.global_batch = cfg, int(seed), global_batch
        self.num_examples = n = len(examples)
        if cfg.mode == "static":
            diff = difficulties(examples, cfg.difficulty_field)
            tie = _rng(self.seed, 1).permutation(n)  # ties (MATH has 5 levels) in a seeded, not file, order
            self.order = np.lexsort((tie, diff))
        self.visits = np.zeros(n, dtype=np.int64)
        self.correct = np.zeros(n, dtype=np.int64)      # completions graded correct, over all visits
        self.completions = np.zeros(n, dtype=np.int64)  # completions drawn, over all visits
        self.flat_streak = np.zeros(n, dtype=np.int64)  # last groups in a row that were all correct or all wrong

    # ------------------------------------------------------------------------------------------------ the order
    def pool_size(self, batch_number: int) -> int:
        c = self.cfg
        frac = c.start_fraction + (1.0 - c.start_fraction) * min(1.0, batch_number / c.pacing_steps)
        return min(self.num_examples, max(self.global_batch, int(np.ceil(frac * self.num_examples - 1e-9))))

    def weights(self) -> np.ndarray:
        """online: [N] sampling weights, retire_weight for retired prompts, 1 for the others."""
        return np.where(self.retired(), self.cfg.retire_weight, 1.0)

    def retired(self) -> np.ndarray:
        return self.flat_streak >= self.cfg.window

    def global_indices(self, batch_number: int) -> np.ndarray:
        """The example indices of global batch `batch_number`, without repeats; the same on every rank."""
        rng = _rng(self.seed, 2, batch_number)
        if self.cfg.mode == "static":
            pool = self.order[:self.pool_size(batch_number)]
            return pool[rng.permutation(len(pool))[:self.global_batch]]
        w = self.weights()
        # Efraimidis-Spirakis: the global_batch largest u^(1/w) are a weighted draw without replacement; exact in
        # float64 on every rank (no cumulative sums whose rounding could differ with the order of additions)
        keys = np.log(rng.random(self.num_examples)) / w
        return np.argsort(-keys, kind="stable")[:self.global_batch]

    # ------------------------------------------------------------------------------------------- the statistics
    def update(self, indices: np.ndarray | list[int], correct: np.ndarray | list[int],
               group_sizes: np.ndarray | list[int]) -> None:
        """One graded global batch: example indices, their correct completions and group sizes (all-reduced)."""
        idx = np.asarray(indices, dtype=np.int64)
        k = np.asarray(correct, dtype=np.int64)
        g = np.asarray(group_sizes, dtype=np.int64)
        if len(idx) != len(k) or len(idx) != len(g) or len(np.unique(idx)) != len(idx):
            raise ValueError("curriculum update needs one (correct, group size) per distinct example index")
        flat = (k == 0) | (k == g)
        self.visits[idx] += 1
        self.correct[idx] += k
        self.completions[idx] += g
        self.flat_streak[idx] = np.where(flat, self.flat_streak[idx] + 1, 0)

    def pass_rate(self) -> np.ndarray:
        """[N] running pass rate: correct / drawn completions over all visits (nan where never visited)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.completions > 0, self.correct / np.maximum(self.completions, 1), np.nan)

    def metrics(self, batch_number: int) -> dict:
        """Identical on every rank (nothing to all-reduce)."""
        if self.cfg.mode == "static":  # static keeps no statistics: its order is the schedule's alone
            return {"curriculum/pool_fraction": self.pool_size(batch_number) / self.num_examples}
        seen = self.visits > 0
        out = {"curriculum/seen_fraction": float(seen.mean())}
        out["curriculum/retired_fraction"] = float(self.retired().mean())
        out["curriculum/solved_fraction"] = float((seen & (self.correct == self.completions)).mean())
        return out

    # ---------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {"mode": self.cfg.mode, "num_examples": self.num_examples, "visits": self.visits.tolist(),
                "correct": self.correct.tolist(), "completions": self.completions.tolist(),
                "flat_streak": self.flat_streak.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_examples") != self.num_examples:
            raise DataError(f"cannot resume the curriculum: the checkpoint's statistics are of "
                            f"{state.get('num_examples')} examples, now there are {self.num_examples}")
        for k in ("visits", "correct", "completions", "flat_streak"):
            v = np.asarray(state[k], dtype=np.int64)
            if v.shape != (self.num_examples,):
                raise DataError(f"cannot resume the curriculum: its '{k}' has shape {v.shape}")
            setattr(self, k, v)


def record_graded(curriculum: Curriculum, sampler, first_rewards, group_size: int | list[int], device) -> None:
    """After a round's grading: this rank's correct counts (the first reward function's full marks, as the
    accuracy metric) go into their slots of the global batch, one all-reduce, and every rank updates the same
    statistics. group_size: num_generations, or the global batch's group sizes (group size by difficulty). Every
    rank makes the call, with prompts or not (the same collectives on every path)."""
    import torch

    from grpo_dist import distributed as gdist
    n = len(sampler.last_global_indices)
    sizes = [group_size] * n if isinstance(group_size, int) else list(group_size)
    start = sampler.rank * sampler.prompts_per_rank
    counts = torch.zeros(sampler.global_batch, dtype=torch.float64)
    local = (torch.as_tensor(first_rewards, dtype=torch.float64) >= 1.0).double()
    if local.numel():
        mine = sizes[start:start + sampler.prompts_per_rank]
        per_group = torch.stack([g.sum() for g in torch.split(local, mine)])
        counts[start:start + len(per_group)] = per_group
    total = gdist.all_reduce_sum(counts.to(device), device)
    curriculum.update(sampler.last_global_indices, total[:n].round().long().numpy(), sizes)


def flat_probability(p: float, g: int) -> float:
    """P(a group of g completions is flat: all correct or all wrong) at pass rate p: p^g + (1 - p)^g."""
    return p ** g + (1.0 - p) ** g


def allocate_group_sizes(correct: np.ndarray, completions: np.ndarray, budget: int, g_min: int,
                         g_max: int) -> list[int]:
    """Group size by difficulty: sizes in [g_min, g_max] summing to `budget` for the prompts of one global batch.

    Each prompt's pass rate is the smoothed p = (correct + 1) / (completions + 2) (an unseen prompt: 1/2). Starting
    from g_min each, the next completion goes to the prompt whose flat probability p^g + (1 - p)^g it lowers the
    most (ties: the earlier prompt), until the budget is spent; f(g) is convex in g, so this greedy choice minimises
    the expected number of flat groups. A pass rate near 0 or 1 (0.9, say) keeps that drop large for longer (more
    completions: the group is less often flat); at 1/2 a few completions already make a flat group unlikely, and at
    almost exactly 0 or 1 it stays flat whatever is added (those get g_min, and the online weights retire them).
    Pure function of the all-reduced statistics: the same on every rank."""
    n = len(correct)
    if not n * g_min <= budget <= n * g_max:
        raise ValueError(f"a budget of {budget} completions does not fit {n} groups of {g_min}..{g_max}")
    p = (np.asarray(correct, dtype=np.float64) + 1.0) / (np.asarray(completions, dtype=np.float64) + 2.0)
    sizes = [g_min] * n
    for _ in range(budget - n * g_min):
        gains = [flat_probability(p[i], sizes[i]) - flat_probability(p[i], sizes[i] + 1) if sizes[i] < g_max
                 else -1.0 for i in range(n)]
        sizes[int(np.argmax(gains))] += 1  # argmax: the first of equal gains
    return sizes

"""PromptSampler: the deterministic, resumable, rank-sharded order in which training prompts are taken."""

from __future__ import annotations

from typing import Any, Optional

from grpo_dist.data.examples import DataError, PromptExample


class PromptSampler:
    """Deterministic, resumable, rank-sharded prompt order.

    Epoch e visits a permutation of all examples drawn from numpy's RNG seeded with (seed, e), identical on every
    rank. A step takes the next global batch of prompts_per_rank * world_size prompts; rank r takes its
    [r * prompts_per_rank, (r + 1) * prompts_per_rank) slice, so ranks are disjoint and all take the same number of
    steps. The last len(examples) % global_batch prompts of each epoch's permutation are dropped (different ones each
    epoch).

    state_dict() records the position (epoch, step_in_epoch) and what it depends on. load_state_dict() refuses a
    state whose seed, number of examples or global batch size differs (the position would then name different
    prompts). A different world_size is accepted when prompts_per_rank * world_size is unchanged: the global batches
    are then exactly the same and only their split across ranks changes.
    """

    def __init__(self, examples: list[PromptExample], prompts_per_rank: int, rank: int, world_size: int, seed: int,
                 curriculum: Any = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        if prompts_per_rank < 1:
            raise DataError(f"prompts_per_rank must be >= 1, got {prompts_per_rank}")
        self.examples = examples
        self.prompts_per_rank = prompts_per_rank
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.global_batch = prompts_per_rank * world_size
        self._steps_per_epoch = len(examples) // self.global_batch
        if self._steps_per_epoch == 0:
            raise DataError(f"{len(examples)} examples is fewer than one global batch of prompts_per_rank x "
                            f"world_size = {prompts_per_rank} x {world_size} = {self.global_batch}")
        self._epoch = 0
        self._step = 0
        self._perm_epoch: Optional[int] = None
        self._perm: Any = None  # numpy permutation of epoch _perm_epoch
        # where next_batch's last batch sits (the per-prompt sampling noise is keyed on it, grpo_dist.sampling_noise):
        # global batches drawn before it, and each of its prompts' place in the global batch
        self.last_batch_number = 0
        self.last_prompt_indices: list[int] = []
        # grpo_dist.curriculum.Curriculum: picks each global batch instead of the epoch permutation (the epoch and
        # step still count batches, so the batch number, the sampling noise and the checkpoint stay as they are)
        self.curriculum = curriculum
        self.last_global_indices: list[int] = []  # example indices of the last global batch (every rank's)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def permutation(self, epoch: int):
        """The order (indices into `examples`) of epoch `epoch`; the same on every rank."""
        if self._perm_epoch != epoch:
            import numpy as np
            # SeedSequence needs non-negative entropy; fold a negative seed into a distinct non-negative value.
            s = self.seed if self.seed >= 0 else (1 << 64) + self.seed
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([s, epoch])))
            self._perm = rng.permutation(len(self.examples))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> list[PromptExample]:
        """This rank's prompts for the next step; rolls over to the next epoch after the last step of one."""
        self.last_batch_number = self._epoch * self._steps_per_epoch + self._step
        if self.curriculum is not None:
            whole = self.curriculum.global_indices(self.last_batch_number)
        else:
            at = self._step * self.global_batch
            whole = self.permutation(self._epoch)[at:at + self.global_batch]
        self.last_global_indices = [int(i) for i in whole]
        start = self.rank * self.prompts_per_rank
        batch = [self.examples[i] for i in self.last_global_indices[start:start + self.prompts_per_rank]]
        self.last_prompt_indices = [self.rank * self.prompts_per_rank + i for i in range(len(batch))]
        self._step += 1
        if self._step >= self._steps_per_epoch:
            self._epoch += 1
            self._step = 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "step_in_epoch": self._step, "seed": self.seed,
                "num_examples": len(self.examples), "world_size": self.world_size,
                "prompts_per_rank": self.prompts_per_rank}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("epoch", "step_in_epoch", "seed", "num_examples", "world_size", "prompts_per_rank")
                   if k not in state]
        if missing:
            raise DataError(f"sampler state is missing {', '.join(missing)}")
        problems = []
        if state["num_examples"] != len(self.examples):
            problems.append(f"the checkpoint had {state['num_examples']} examples, now there are "
                            f"{len(self.examples)} (data.path / data.limit / preset changed?)")
        if state["seed"] != self.seed:
            problems.append(f"the checkpoint's data seed is {state['seed']}, now {self.seed}")
        old_gb = state["prompts_per_rank"] * state["world_size"]
        if old_gb != self.global_batch:
            problems.append(f"the checkpoint's global batch is prompts_per_rank x world_size = "
                            f"{state['prompts_per_rank']} x {state['world_size']} = {old_gb}, now "
                            f"{self.prompts_per_rank} x {self.world_size} = {self.global_batch} (a different world "
                            f"size is fine only with the same global batch)")
        if problems:
            raise DataError("cannot resume the prompt order: " + "; ".join(problems))
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step <= self._steps_per_epoch:
            raise DataError(f"sampler state position epoch={epoch} step_in_epoch={step} is invalid "
                            f"({self._steps_per_epoch} steps per epoch)")
        if step == self._steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._epoch, self._step = epoch, step

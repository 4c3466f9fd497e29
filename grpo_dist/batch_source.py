"""Where the trainer's graded batches come from: `batch = source.next_batch(step)` (the batch-source seam). Two
sources answer, and the trainer does not know which:

    ColocatedSource      this rank samples and grades (rollout_ranks = 0): weight sync into its own rollout engine,
                         sampling, grading, dynamic sampling, curriculum statistics
    RolloutRankSource    the rollout ranks sample and grade (rollout_ranks > 0, async_rollout.py); this rank sends
                         prompts and weights and receives graded batches

Both run one round as graded.sample_and_grade (a rollout rank runs it in async_rollout.serve), and both keep
DAPO's dynamic sampling in one function (dynamic_sample) over their rounds. Every collective here is over the
trainer ranks and runs on every trainer rank in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from grpo_dist import distributed as gdist
from grpo_dist.advantages import dynamic_sampling_quota, zero_advantage_groups
from grpo_dist.curriculum import allocate_group_sizes, record_graded
from grpo_dist.graded import Graded, sample_and_grade
from grpo_dist.rollout import RolloutBatch, concat_rollouts
from grpo_dist.rollout_engines import rollout_dtype
from grpo_dist.trained_prompts import record as record_prompts


class RewardFunctionError(RuntimeError):
    """A reward function failed on every completion of a step."""


@dataclass
class StepBatch:
    """The step's graded rows on this rank, and what getting them cost (next_batch's answer)."""
    batch: RolloutBatch
    rewards: list[float]
    per_function: dict[str, list[float]]
    reward_errors: dict[str, int] = field(default_factory=dict)  # reward_errors/<name>: all ranks, all rounds
    decode: tuple[int, int] = (0, 0)    # decode row-steps computed, tokens generated (this rank, all rounds)
    prompts_cut: int = 0                # prompts longer than max_prompt_length (this rank, all rounds)
    group_sizes: list[int] | None = None         # this rank's groups (None: num_generations each)
    global_group_sizes: list[int] | None = None  # the global batch's, the same on every rank
    sampling: dict = field(default_factory=dict)  # dynamic_sampling_* metrics
    weight_sync_s: float = 0.0


def reward_error_counts(errors: dict, n_local: int, names: list[str], cfg, device, step: int) -> dict:
    """reward_errors/<name>: completions of this round (all ranks) each function failed on. Stops the run when a
    function failed on all of them (reward_fail_on_all_errors): that is a broken function, not a bad model.
    Collective."""
    s = gdist.all_reduce_sum_named({**{f"errors/{k}": errors.get(k, 0) for k in names}, "completions": n_local},
                                   device)
    total = int(s["completions"])
    counts = {name: int(s[f"errors/{name}"]) for name in names}
    for name, count in counts.items():
        if cfg.reward_fail_on_all_errors and total and count == total:
            raise RewardFunctionError(
                f"reward function '{name}' failed on all {total} completions of step {step + 1} (the first "
                f"failure is printed above); fix it, or set reward_fail_on_all_errors=false to train on")
    return {f"reward_errors/{name}": count for name, count in counts.items()}


def dynamic_sample(next_round, cfg, ctx, pad_id: int) -> tuple[Graded, dict]:
    """DAPO dynamic sampling over rounds next_round(first) of prompts_per_rank prompts per rank, keeping only groups
    whose rewards differ, until all ranks together hold prompts_per_rank x world_size of them or
    dynamic_sampling_max_rounds rounds ran. Every rank runs the same rounds (the stop test is on all-reduced
    counts); the surplus of the last round is trimmed evenly (advantages.dynamic_sampling_quota). A rank may end
    with fewer groups than the others, even none. Returns the kept rows as one Graded and the metrics."""
    G, dev = cfg.num_generations, ctx.device
    target = cfg.prompts_per_rank * ctx.world_size
    kept: list = []
    rounds = 0
    while True:
        g = next_round(rounds == 0)
        rounds += 1
        flat = zero_advantage_groups(torch.tensor(g.rewards, dtype=torch.float32), G)
        kept += [(g, i) for i in range(len(flat)) if not flat[i]]
        total = int(gdist.all_reduce_sum([len(kept)], dev)[0])
        if total >= target or rounds >= cfg.dynamic_sampling_max_rounds:
            break
    sampling = {"dynamic_sampling_rounds": rounds, "dynamic_sampling_prompts": rounds * target,
                "dynamic_sampling_groups": min(total, target)}
    if total == 0:  # every group of every rank was flat: the last round, as without dynamic sampling
        return g, sampling
    counts = gdist.all_reduce_sum([len(kept) if r == ctx.rank else 0 for r in range(ctx.world_size)], dev)
    kept = kept[:dynamic_sampling_quota([int(c) for c in counts], target)[ctx.rank]]
    rows = [(k, i * G + j) for k, i in kept for j in range(G)]
    batch = concat_rollouts([k.batch.rows([r]) for k, r in rows], pad_id) if rows else g.batch.rows([])
    rewards = [k.rewards[r] for k, r in rows]
    per_function = {name: [k.per_function[name][r] for k, r in rows] for name in g.per_function}
    return Graded(batch, rewards, per_function), sampling


class _Rounds:
    """The per-step bookkeeping both sources share: each round's reward errors (all-reduced), decode tokens and
    cut prompts add up into the step's StepBatch."""

    def __init__(self):
        self.errors: dict[str, int] = {}
        self.decode = [0, 0]
        self.prompts_cut = 0

    def add(self, g: Graded, names, cfg, ctx, step: int) -> Graded:
        # before the update: a broken function stops the run (every rank runs the same rounds: same collectives)
        counts = reward_error_counts(g.errors, len(g.rewards), names, cfg, ctx.device, step)
        self.errors = {k: self.errors.get(k, 0) + v for k, v in counts.items()}
        self.decode = [self.decode[0] + g.decode[0], self.decode[1] + g.decode[1]]
        self.prompts_cut += g.batch.prompts_truncated
        return g

    def step_batch(self, g: Graded, sampling: dict, **extra) -> StepBatch:
        return StepBatch(g.batch, g.rewards, g.per_function, self.errors, tuple(self.decode), self.prompts_cut,
                         sampling=sampling, **extra)


def _timed(timer, name):
    return timer(name) if timer is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def push_weights(engine, weights, cfg) -> float:
    """The policy's current weights (weights(dtype): Engine.iter_full_weights, a collective) into a local rollout
    engine, streamed one FSDP unit at a time in the compute dtype. Returns the seconds it took."""
    t0 = time.perf_counter()
    it = weights(rollout_dtype(cfg))
    engine.sync_weights(it)
    if next(it, None) is not None:  # every rank must run every unit's all-gather, and nothing is stale
        raise RuntimeError(f"the {engine.name} rollout engine did not take every weight")
    return time.perf_counter() - t0


class ColocatedSource:
    """This rank samples and grades its own prompts (rollout_ranks = 0): the data sampler's next batch, the policy's
    weights into the rollout engine once per step, sample_and_grade, and with dynamic_sampling more rounds on the
    same weights; curriculum statistics after each round (online), group sizes by difficulty before it."""

    def __init__(self, cfg, ctx, sampler, curriculum, rollout_engine, tokenizer, rewards, eos_ids, weights,
                 environment):
        """weights(dtype): an iterator of the policy's full weights (Engine.iter_full_weights; a collective).
        environment: what runs an episode (grpo_dist/environments/: single-turn, or multi-turn with tools)."""
        self.cfg, self.ctx, self.sampler, self.curriculum = cfg, ctx, sampler, curriculum
        self.engine, self.tokenizer, self.rewards, self.eos_ids = rollout_engine, tokenizer, rewards, eos_ids
        self.weights, self.environment = weights, environment
        self.weight_sync_s = 0.0
        self._sizes: tuple[list[int] | None, list[int] | None] = (None, None)  # (this rank's, global) group sizes

    def sync_weights(self) -> None:
        """The policy's current weights into the rollout engine, streamed one FSDP unit at a time in the compute
        dtype. Collective: every rank runs it."""
        self.weight_sync_s = push_weights(self.engine, self.weights, self.cfg)

    def next_batch(self, step: int, timer=None) -> StepBatch:
        """Rollout and grade (rounds of them with dynamic sampling) of step `step` (0-based). Collective."""
        rounds = _Rounds()

        def one(first: bool) -> Graded:
            g = rounds.add(self._round(step, timer, first), self.rewards.names, self.cfg, self.ctx, step)
            if self.curriculum is not None and self.cfg.curriculum.mode == "online":  # each prompt's pass rates
                record_graded(self.curriculum, self.sampler, next(iter(g.per_function.values()), g.rewards),
                              self._sizes[1] or self.cfg.num_generations, self.ctx.device)
            return g
        if self.cfg.dynamic_sampling:
            g, sampling = dynamic_sample(one, self.cfg, self.ctx, self.tokenizer.pad_token_id)
        else:
            g, sampling = one(True), {}
        mine, everyone = self._sizes
        return rounds.step_batch(g, sampling, group_sizes=mine, global_group_sizes=everyone,
                                 weight_sync_s=self.weight_sync_s)

    def _round(self, step: int, timer, first: bool) -> Graded:
        """One round of prompts_per_rank prompts; the first of a step syncs the weights (they do not change
        between rounds)."""
        with _timed(timer, "rollout"):
            examples = self.sampler.next_batch()
            record_prompts(step + 1, self.ctx.rank, self.sampler)  # GRPO_DIST_TRAINED_PROMPTS (tests)
            self._sizes = self._plan_group_sizes()
            if first:
                self.sync_weights()
        return self.rollout(examples, timer)

    def rollout(self, examples, timer=None) -> Graded:
        """Sample and grade `examples`, the data sampler's last batch (its place keys the sampling noise)."""
        return sample_and_grade(self.cfg, self.engine, self.tokenizer, self.rewards, examples,
                                batch_number=self.sampler.last_batch_number,
                                prompt_indices=list(self.sampler.last_prompt_indices), eos_ids=self.eos_ids,
                                device=self.ctx.device, group_sizes=self._sizes[0], stage=timer,
                                generate=self.environment.rollout)

    def _plan_group_sizes(self) -> tuple[list[int] | None, list[int] | None]:
        """Group size by difficulty: the sizes of the global batch the sampler just drew, from the all-reduced
        statistics (the same on every rank), and this rank's slice of them; (None, None) when off."""
        c = self.cfg.curriculum
        if self.curriculum is None or c.num_generations_min is None or c.num_generations_max is None:
            return None, None
        idx = self.sampler.last_global_indices
        everyone = allocate_group_sizes(self.curriculum.correct[idx], self.curriculum.completions[idx],
                                        len(idx) * self.cfg.num_generations, c.num_generations_min,
                                        c.num_generations_max)
        start = self.ctx.rank * self.cfg.prompts_per_rank
        return everyone[start:start + self.cfg.prompts_per_rank], everyone

    def start(self, step: int) -> None:
        """Before the first step: nothing goes out ahead."""

    def after_step(self, step: int, step_time_s: float) -> dict:
        """After the optimizer step: nothing to send, no metrics of its own."""
        return {}

    def finish(self) -> None:
        """The run ended normally: nothing in flight."""

    def abort(self, error: BaseException) -> None:
        """The run fails: no peer to tell."""

    def release(self) -> None:
        self.engine.release()

    def close(self) -> None:
        self.engine.close()


class RolloutRankSource:
    """The rollout ranks sample and grade (rollout_ranks > 0): each round is the next graded batch of the pipeline
    of async_rollout.AsyncRollouts (prompts and weights go out ahead, max_staleness versions at most). With
    dynamic_sampling a step takes more rounds from the pipeline, each replaced by a new batch at once."""

    def __init__(self, cfg, ctx, rollouts, reward_names: list[str], pad_id: int, weights, local_engine):
        """weights(dtype): the policy's full weights (for the local engine); local_engine(): builds the engine this
        rank evaluates with (eval_steps), on first use: the rollout ranks' engines are busy sampling ahead."""
        self.cfg, self.ctx, self.rollouts, self.names, self.pad_id = cfg, ctx, rollouts, reward_names, pad_id
        self.weights, self._build, self._engine = weights, local_engine, None
        self.weight_sync_s = 0.0

    @property
    def engine(self):
        """This rank's own rollout engine, for evaluation only (a replica: memory spent only with eval_steps)."""
        if self._engine is None:
            self._engine = self._build()
        return self._engine

    def sync_weights(self) -> None:
        """The policy's weights into this rank's evaluation engine. Collective (trainer ranks)."""
        self.weight_sync_s = push_weights(self.engine, self.weights, self.cfg)

    def start(self, step: int) -> None:
        """The first max_staleness + 1 batches go out."""
        self.rollouts.start(step)

    def after_step(self, step: int, step_time_s: float) -> dict:
        """The new version's weights out with the next batch's prompts; the async/* metrics (trainer ranks)."""
        self.rollouts.after_step(step)
        return self.rollouts.metrics(step_time_s)

    def finish(self) -> None:
        """Take what is still in flight, then stop the rollout ranks (not after an error: the peers may be gone)."""
        self.rollouts.close()

    def abort(self, error: BaseException) -> None:
        """The rollout ranks stop now, naming this failure (best effort)."""
        self.rollouts.abort(error)

    def next_batch(self, step: int, timer=None) -> StepBatch:
        """The graded batch(es) of step `step`, received from this rank's rollout rank. Collective (trainers)."""
        rounds = _Rounds()

        def one(first: bool) -> Graded:
            if not first:  # one more round of this step: its replacement goes out first, on the same weights
                self.rollouts.refill(step)
            with _timed(timer, "rollout"):
                g = self.rollouts.receive(step)
            return rounds.add(g, self.names, self.cfg, self.ctx, step)
        if self.cfg.dynamic_sampling:
            g, sampling = dynamic_sample(one, self.cfg, self.ctx, self.pad_id)
        else:
            g, sampling = one(True), {}
        return rounds.step_batch(g, sampling)

    def release(self) -> None:
        if self._engine is not None:
            self._engine.release()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

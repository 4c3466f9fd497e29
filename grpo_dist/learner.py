"""The stages after grading, on one step's graded batch (this rank's rows), in order:

    advantage     rewards less beta * KL (kl_in_reward), z-scored inside each group (groups never cross ranks)
    select rows   the rows that train, the step's loss normaliser (all-reduced), micro-batches of similar length
                  (max_tokens_per_micro_batch: rows balanced between ranks by tokens, then bin-packed by token
                  count; micro_batches.py)
    log-probs     reference (KL in the loss) and old (num_iterations > 1, or the proximal policy of stale
                  rollouts) in no-grad passes, on packed rows where the model allows (padding_free; packing.py)
    update        token-masked clipped ratio + beta * KL, micro-batched, one optimizer step per iteration

The step's data lives in one StepState, passed from stage to stage: the graded batch, advantages, rows, token
counts, packed layouts and the non-finite votes (nonfinite.Votes); nothing of a step is kept on the Learner.
Every rank runs the same passes (micro-batch counts are agreed first, short ranks run empty micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_dist import distributed as gdist
from grpo_dist import faults
from grpo_dist import micro_batches as mbatch
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.advantages import group_advantages, zero_advantage_groups
from grpo_dist.batch_source import StepBatch
from grpo_dist.losses import LossSpec, grpo_loss, k3_kl, kl_estimate, truncated_is_weights, uses_sequence_normaliser
from grpo_dist.packing import PassTokens, completion_log_probs, pack_rows
from grpo_dist.prompt_sharing import group_order, prompt_groups
from grpo_dist.rollout import RolloutBatch, cut_off
from grpo_dist.sft import SFTBatch

PASSES = ("reference", "old", "train")  # the passes whose tokens are counted (the old pass: the policy, no grad)
EMPTY_PASS_TOKENS = 2  # the forward an empty micro-batch runs to keep the collectives in step


def _detached(x):
    """A metric term as a device value without gradient (losses.py may give tensors or plain numbers)."""
    return x.detach() if isinstance(x, torch.Tensor) else x


@dataclass
class StepState:
    """One step's data, passed from stage to stage and returned (GRPOTrainer.last_step)."""
    graded: StepBatch                   # what the rollout produced (source.next_batch)
    rewards: torch.Tensor               # float32, this rank's rows
    correct: torch.Tensor               # the rows the verifier gave full marks
    tokens: dict[str, PassTokens] = field(default_factory=lambda: {name: PassTokens() for name in PASSES})
    layouts: dict = field(default_factory=dict)  # (batch, rows) -> (batch, micro-batch, packed layout)
    votes: nonfinite.Votes = field(default_factory=nonfinite.Votes)
    advantages: torch.Tensor | None = None  # this rank's, on the host
    flat_groups: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)  # the rows that train
    sums: dict = field(default_factory=dict)       # metric sums of the update (device values)
    grad_norms: list[float] = field(default_factory=list)
    applied: int = 0                    # optimizer steps applied (of num_iterations)
    counted: bool = False               # whether the step trained anything (then it counts for the non-finite guard)
    sft: SFTBatch | None = None
    skip_note: tuple[str, str] | None = None  # (what, advice) of a skipped step, for the health line
    completion_tokens: float = 0.0      # per rank, for tokens/s (step_metrics)
    attention_pairs: float = 0.0        # all ranks, for mfu (step_metrics)

    @property
    def batch(self) -> RolloutBatch:
        return self.graded.batch

    @property
    def group_sizes(self) -> list[int] | None:
        return self.graded.group_sizes


def loss_spec(cfg, kl_in_loss: bool) -> LossSpec:
    """The loss's settings from the config; beta is 0 unless the KL term is in the loss."""
    return LossSpec(loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    beta=cfg.beta if kl_in_loss else 0.0, kl_estimator=cfg.kl_estimator,
                    importance_sampling_level=cfg.importance_sampling_level, dual_clip_c=cfg.effective_dual_clip_c,
                    entropy_coef=cfg.entropy_coef, max_completion_length=cfg.max_completion_length)


# ------------------------------------------------------------------------------------------------- advantage
def advantages(cfg, rewards: torch.Tensor, group_sizes: list[int] | None,
               device) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages of this rank's rows, which groups are flat: all rewards equal). Groups are rank-local; with
    scale_rewards=batch the std is over every rank's rewards (collective)."""
    G, scale = group_sizes or cfg.num_generations, cfg.scale_rewards
    batch_std = batch_reward_std(rewards, device) if scale == "batch" else None
    return group_advantages(rewards, G, scale, batch_std).to(device), zero_advantage_groups(rewards, G)


def batch_reward_std(rewards: torch.Tensor, device) -> float:
    """The sample std of the rewards of all ranks (one all-reduce)."""
    s = gdist.all_reduce_sum_named({"sum": rewards.sum(), "sum_sq": (rewards.double() ** 2).sum(),
                                    "n": len(rewards)}, device)
    mean = s["sum"] / s["n"]
    return float(torch.sqrt((s["sum_sq"] - s["n"] * mean ** 2).clamp(min=0) / (s["n"] - 1).clamp(min=1)))


# ---------------------------------------------------------------------------------------------- select rows
def select_rows(cfg, batch: RolloutBatch, flat_groups: torch.Tensor, group_sizes: list[int] | None,
                eos_ids) -> list[int]:
    """The rows that train: all, less flat groups (skip_zero_advantage_groups) and cut-off completions
    (mask_truncated_completions: out of the loss and its normaliser; their group statistics stand)."""
    G = cfg.num_generations
    rows = list(range(len(batch)))
    group_of = [i // G for i in rows] if group_sizes is None else \
        [g for g, size in enumerate(group_sizes) for _ in range(size)]
    if cfg.skip_zero_advantage_groups:
        rows = [i for i in rows if not flat_groups[group_of[i]]]
    if cfg.mask_truncated_completions:
        truncated = cut_off(batch, eos_ids)
        rows = [i for i in rows if not truncated[i]]
    return rows


def step_normaliser(cfg, batch: RolloutBatch, rows: list[int], device) -> float:
    """The loss's divisor for the whole optimizer step, over all micro-batches and ranks (one all-reduce): the
    trained sequences or tokens, as loss_type says. 0 when no rank trains a row."""
    lengths = batch.loss_mask.sum(-1)  # the model's tokens (multi-turn: observations are not trained on)
    local = float(len(rows)) if uses_sequence_normaliser(cfg.loss_type) else float(lengths[rows].sum())
    return float(gdist.all_reduce_sum([local], device)[0])


class Learner:
    """The policy's side of a step: the stages of the module docstring on a StepState. It holds what every step
    uses (engine, reference, loss settings), never a step's data."""

    def __init__(self, cfg, ctx, engine, ref_model, tokenizer, eos_ids, *, padding_free: bool,
                 share_prompts: bool, sft, behaviour_ratio: bool, checkpoint_note):
        """checkpoint_note(): the newest intact checkpoint, for the message of an update that broke the weights."""
        self.cfg, self.ctx, self.engine, self.ref_model, self.tokenizer = cfg, ctx, engine, ref_model, tokenizer
        self.eos_ids = eos_ids
        self.padding_free, self.share_prompts, self.sft = padding_free, share_prompts, sft
        self.behaviour_ratio = behaviour_ratio  # stale rollouts: decoupled PPO's behaviour weight is always on
        self.checkpoint_note = checkpoint_note
        self.loss_spec = loss_spec(cfg, self.kl_in_loss())

    def kl_in_loss(self) -> bool:
        return self.ref_model is not None and not self.cfg.kl_in_reward

    def learn(self, state: StepState, step: int, timer) -> StepState:
        """advantage, select rows, log-probs, update on state (step: optimizer steps taken before this one)."""
        cfg, dev = self.cfg, self.ctx.device
        batch = state.graded.batch = state.graded.batch.to(dev)
        with timer("logprobs"):
            shaped, seq_kl = self.kl_shaped_rewards(state)
        watchdog.set_phase("advantage")
        adv, state.flat_groups = advantages(cfg, shaped, state.group_sizes, dev)
        state.advantages = adv.detach().cpu()
        state.votes.flags = nonfinite.local_flags(state.rewards, adv)
        rows = state.rows = select_rows(cfg, batch, state.flat_groups, state.group_sizes, self.eos_ids)
        # the kl metric is a mean over the trained tokens: its numerator sums the KL of the trained rows only
        reward_kl = float(seq_kl[rows].sum()) if seq_kl is not None and rows else 0.0
        normaliser = step_normaliser(cfg, batch, rows, dev)
        train, train_adv, micro = self.plan_micro_batches(batch, rows, adv)
        with timer("logprobs"):
            ref_logps, old_logps = self.reference_and_old_logps(state, train, micro)
        state.sft = self.sft.next_batch() if self.sft is not None else None  # SFT + RL: this step's solutions
        with timer("update"):
            self.update(state, step, train, micro, train_adv, normaliser, ref_logps, old_logps, reward_kl)
        return state

    # advantage
    def kl_shaped_rewards(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kl_in_reward: reward - beta * sum over the completion's tokens of the KL estimate between the policy
        before this update and the reference (no gradient). Returns (rewards, each row's summed KL, for the
        metric). Identity (and None) otherwise. Every rank runs the same number of scoring passes."""
        cfg, batch, rewards = self.cfg, state.batch, state.rewards
        if not (cfg.kl_in_reward and self.ref_model is not None):
            return rewards, None
        micro = self.micro_batches(batch, list(range(len(batch))))
        ref = self.score(self.ref_model, batch, micro, state.tokens["reference"], state.layouts)
        pol = self.score(self.engine.module, batch, micro, state.tokens["old"], state.layouts)  # before the update
        seq_kl = torch.zeros(len(batch), dtype=torch.float32, device=self.ctx.device)
        for idx, r, p in zip(micro, ref, pol):
            if idx:
                mask = batch.loss_mask[idx][:, :p.shape[1]].to(p.dtype)
                seq_kl[idx] = (kl_estimate(p, r, cfg.kl_estimator) * mask).sum(-1)
        return rewards - cfg.beta * seq_kl.to(rewards.device), seq_kl

    # select rows
    def plan_micro_batches(self, batch: RolloutBatch, rows: list[int],
                           adv: torch.Tensor) -> tuple[RolloutBatch, torch.Tensor, list[list[int]]]:
        """(batch, advantages, micro-batches) of the log-prob and update passes. With max_tokens_per_micro_batch on
        several ranks, the training rows are first balanced between ranks by tokens (collective; the update does not
        depend on where a row trains: micro_batches.py), and the batch returned holds this rank's new rows."""
        if self.cfg.max_tokens_per_micro_batch is not None and self.ctx.world_size > 1:
            batch, adv = mbatch.balance_ranks(batch, rows, adv, self.tokenizer.pad_token_id, self.ctx.rank,
                                              self.ctx.world_size, self.ctx.device, self.share_prompts)
            rows = list(range(len(batch)))
        return batch, adv, self.micro_batches(batch, rows)

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """rows in micro-batches (micro_batch_size slices of the length order, or bin-packed by token count under
        max_tokens_per_micro_batch), then empty ones up to the count of the rank with the most (one all-reduce):
        every rank runs the same number of passes."""
        cfg = self.cfg
        lengths = mbatch.row_lengths(batch, rows)
        if cfg.max_tokens_per_micro_batch is None:
            size = cfg.micro_batch_size
            if self.share_prompts:  # a prompt's rows together, so that they share it
                order = group_order(batch.prompt_ids, batch.prompt_mask, rows, lengths)
            else:
                order = sorted(rows, key=lambda i: sum(lengths[i]))  # similar lengths together: less padding
            micro = [order[i:i + size] for i in range(0, len(order), size)]
            n_micro = int(gdist.all_reduce_max([len(micro)], self.ctx.device)[0])
        else:
            # share_prompts: a prompt's rows as one item, its prompt counted once
            groups = prompt_groups(batch.prompt_ids, batch.prompt_mask, rows) if self.share_prompts else None

            def plan(at_least):
                return mbatch.plan_token_budget(lengths, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size,
                                                self.padding_free, at_least, groups)
            micro = plan(1)
            n_micro = int(gdist.all_reduce_max([len(micro)], self.ctx.device)[0])
            if len(micro) < n_micro:  # the passes run anyway: smaller micro-batches rather than empty ones
                smaller = plan(n_micro)
                micro = smaller if len(smaller) <= n_micro else micro
        return micro + [[] for _ in range(n_micro - len(micro))]

    # log-probs
    def reference_and_old_logps(self, state: StepState, batch: RolloutBatch,
                                micro: list[list[int]]) -> tuple[list, list]:
        """Per micro-batch, the no-grad log-probs of the reference (KL in the loss) and of the policy before the
        update (num_iterations > 1); None where not run (with one iteration the training pass's own detached
        log-probs are the old ones)."""
        unused = [None] * len(micro)
        ref = self.score(self.ref_model, batch, micro, state.tokens["reference"], state.layouts) \
            if self.kl_in_loss() else unused
        # the policy before the update: "old" for PPO epochs, the proximal policy of decoupled PPO (stale rollouts)
        wanted = self.cfg.num_iterations > 1 or self.behaviour_ratio
        old = self.score(self.engine.module, batch, micro, state.tokens["old"], state.layouts) if wanted \
            else unused
        return ref, old

    def score(self, model, batch: RolloutBatch, micro: list[list[int]], count: PassTokens,
              layouts: dict | None = None) -> list:
        """No-grad per-token log-probs [rows, C] of each micro-batch (for the reference, or the old policy); None
        for an empty micro-batch. count receives the pass's tokens; layouts: the step's packed layouts."""
        out: list = []
        layouts = {} if layouts is None else layouts
        with torch.no_grad():
            for idx in micro:
                if not idx:
                    model(**self.empty_inputs())  # keep the FSDP all-gathers in step with other ranks
                    count.processed += EMPTY_PASS_TOKENS
                    out.append(None)
                    continue
                mb, packed = self.layout(layouts, batch, idx)
                out.append(completion_log_probs(model, mb, packed, count, self.cfg.temperature,
                                                self.cfg.logprob_chunk_size)[0])
        return out

    def layout(self, layouts: dict, batch: RolloutBatch, idx: list[int]):
        """(micro-batch, packed layout or None) of these rows, built once per step from host copies and read by the
        reference, old and training passes and every iteration (no host sync inside a pass)."""
        key = (id(batch), tuple(idx))
        if key not in layouts:
            mb = batch.rows(idx)
            layouts[key] = (batch, mb, pack_rows(mb, self.share_prompts) if self.padding_free else None)
        return layouts[key][1:]

    # update
    def update(self, state: StepState, step: int, batch: RolloutBatch, micro: list[list[int]], adv: torch.Tensor,
               normaliser: float, ref_logps: list, old_logps: list, reward_kl: float) -> None:
        """num_iterations optimizer steps, each over every planned micro-batch (an empty one runs a zero-loss pass).
        An iteration's step is skipped on every rank when any rank's rewards, advantages, loss or gradient norm
        were not finite, or no rank trains a row; an applied step that leaves the parameters non-finite or >10x
        larger stops the run at once (nonfinite.py). Sets the metric sums, each iteration's grad norm, how many
        steps applied and the first cause seen (state.votes.cause).

        Metrics are means over the tokens trained (rows of skipped flat groups excluded); loss, policy_loss, kl
        and entropy are taken at iteration 0, ratio and clip over every iteration (iteration 0's ratio is 1). The
        kl sum starts from the reward's KL of the trained rows (kl_in_reward). With SFT + RL (state.sft), every
        iteration adds the SFT micro-batch's forward / backward on every rank; its step applies even when no rank
        trains an RL row."""
        cfg, sft, rank = self.cfg, state.sft, self.ctx.rank
        # metric sums stay on the device (0-dim tensors once added to) and are read once, in step_metrics
        state.sums = dict(loss=0.0, pg=0.0, kl=reward_kl, clipped=0.0, ratio=0.0, entropy=0.0,
                          sampler_diff=0.0, sampler_kl=0.0, is_weight=0.0, dual_clipped=0.0)
        for it in range(cfg.num_iterations):
            bad = torch.zeros((), dtype=torch.bool, device=self.ctx.device)  # a non-finite loss, read at the vote
            for idx, ref, old in zip(micro, ref_logps, old_logps):
                if idx:
                    bad = bad | self.train_micro_batch(state, step, self.layout(state.layouts, batch, idx),
                                                       adv[idx], normaliser, ref, old, it)
                else:
                    self.empty_backward(state.tokens["train"])
            if self.sft is not None and sft is not None:
                bad = bad | (not self.sft.backward(self.engine, sft, it == 0))
            for fault in ("kill", "stop", "sigint", "term"):  # tests (faults.py)
                faults.inject(fault, step + 1, rank)
            seen = state.votes.vote(bool(bad), self.ctx.device)
            skip = seen is not None or (normaliser == 0 and sft is None)
            before_sq = 0.0 if skip else nonfinite.parameter_norm_sq(self.trainable())
            result = self.engine.step(skip=skip)
            if not skip and not result.applied:
                seen = "gradient"
            if result.applied:
                self.check_update(before_sq, step)
            state.votes.cause = state.votes.cause or seen
            state.grad_norms.append(result.grad_norm)
            state.applied += int(result.applied)
        state.counted = normaliser > 0 or sft is not None

    def trainable(self) -> list[torch.Tensor]:
        """This rank's trainable parameters (its shards under FSDP)."""
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def check_update(self, before_sq: float, step: int) -> None:
        """Stop (exit 3) before anything saves or samples from them when the applied update left the parameters
        non-finite or absurdly larger (nonfinite.py); one all-reduce of this rank's sums of squares."""
        s = gdist.all_reduce_sum([before_sq, nonfinite.parameter_norm_sq(self.trainable())], self.ctx.device)
        problem = nonfinite.parameter_problem(float(s[0]), float(s[1]))
        if problem:
            raise nonfinite.NonFiniteError(
                f"parameters: {problem} at step {step + 1} (learning_rate {self.engine.current_lr():.3g}); "
                f"stopping before any checkpoint holds them. {self.checkpoint_note()}. "
                f"Lower learning_rate{nonfinite.precision_advice(self.cfg)}")

    def train_micro_batch(self, state: StepState, step: int, layout, adv: torch.Tensor, normaliser: float,
                          ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None, it: int) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (its layout) at iteration `it`; its metric terms are added
        to state.sums (on the device). Returns whether its loss was non-finite, as a device flag: nothing here waits
        for the device."""
        first, sums, cfg = it == 0, state.sums, self.cfg
        mb, packed = layout
        want = "grad" if cfg.entropy_coef != 0.0 else ("metric" if first else None)
        logp, entropy = completion_log_probs(self.engine.module, mb, packed, state.tokens["train"], cfg.temperature,
                                             cfg.logprob_chunk_size, want)  # [rows, C]
        if first and entropy is not None:
            sums["entropy"] += (entropy.detach() * mb.loss_mask).sum()
        c = logp.shape[1]
        old = old_logp[:, :c] if old_logp is not None else logp.detach()  # stale rollouts: the proximal policy
        ref = ref_logp[:, :c] if ref_logp is not None else None
        is_weights = self.sampler_terms(mb, old, sums if first else None)
        terms = grpo_loss(logp, old, adv, mb.loss_mask, normaliser=max(normaliser, 1.0),
                          spec=self.loss_spec, ref_logp=ref, entropy=entropy, is_weights=is_weights)
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average.
        loss = terms.loss * self.ctx.world_size
        if faults.inject("nan", step + 1, self.ctx.rank):
            loss = loss * float("nan")
        bad = ~torch.isfinite(loss.detach())
        self.engine.backward(loss)
        if faults.inject("nan_grad", step + 1, self.ctx.rank):
            for p in self.trainable():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if first:
            sums["loss"] += terms.loss.detach()
            sums["pg"] += _detached(terms.pg_sum)
            sums["kl"] += _detached(terms.kl_sum)
        sums["clipped"] += _detached(terms.clipped_sum)
        sums["dual_clipped"] += _detached(terms.dual_clipped_sum) if terms.dual_clipped_sum is not None else 0.0
        sums["ratio"] += _detached(terms.ratio_sum)
        return bad

    @torch.no_grad()
    def sampler_terms(self, mb: RolloutBatch, old: torch.Tensor, sums: dict | None) -> torch.Tensor | None:
        """Sampler/trainer mismatch on this micro-batch's completion tokens (added to sums on the first
        iteration) and the truncated importance weights of config key sampler_correction (None when off)."""
        if mb.sampler_logprobs is None:
            if self.cfg.sampler_correction != "none":
                raise ValueError("sampler_correction needs the rollout engine's log-probs (batch.sampler_logprobs)")
            return None
        sampler, mask = mb.sampler_logprobs.to(old.dtype), mb.loss_mask.to(old.dtype)
        weights = None
        mode = self.cfg.sampler_correction
        if mode == "none" and self.behaviour_ratio:  # decoupled PPO: the behaviour weight is never off
            mode = "token"
        if mode != "none":
            weights = truncated_is_weights(old, sampler, mask, mode, self.cfg.sampler_correction_cap)
        if sums is not None:
            sums["sampler_diff"] += ((old - sampler).abs() * mask).sum()
            # KL(sampler || trainer), k3, in float64: for differences ~1e-5 fp32 rounding would swamp its ~d^2/2
            sums["sampler_kl"] += (k3_kl(sampler.double(), old.double()) * mask).sum()
            if weights is not None:
                sums["is_weight"] += (weights * mask).sum()
        return weights

    def empty_inputs(self) -> dict:
        pad = self.tokenizer.pad_token_id
        ids = torch.full((1, EMPTY_PASS_TOKENS), pad, dtype=torch.long, device=self.ctx.device)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, use_cache=False)

    def empty_backward(self, count: PassTokens) -> None:
        """A rank with fewer micro-batches still runs forward + backward (zero loss) so FSDP's collectives match."""
        out = self.engine.module(**self.empty_inputs())
        count.processed += EMPTY_PASS_TOKENS
        self.engine.backward(out.logits.sum() * 0.0)

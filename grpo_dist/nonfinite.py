"""The non-finite guard: which stage of a step went non-finite, and the message that names it.

A step is not applied (weights, optimizer moments and LR schedule stay as they were) when, on any rank,

    reward      a total reward is not finite in float32, the dtype it trains in (|weight x score| > 3.4e38: a
                reward function's score is finite, or it would have been a reward error, but far too large)
    advantage   an advantage is not finite while the rewards are (their spread overflows float32 with
                scale_rewards=none, or a non-finite KL penalty of kl_in_reward)
    loss        the loss is NaN/inf (with finite advantages)
    gradient    the loss is finite but the global gradient norm is not

max_consecutive_nonfinite such steps in a row stop the run (exit 3). One cause is not skippable:

    parameters  after an applied optimizer step the parameters are non-finite, or their norm grew more than
                PARAMETER_GROWTH_LIMIT times in that one step (a finite loss does not mean a sane update: with
                learning_rate=1e10 step 1 moves every weight by ~1e10)

It stops the run at once (exit 3), before any checkpoint or weight sync sees those parameters. Undoing the step
would need a copy of the weights and the optimizer state (2-3x the model's memory, every step); the newest
checkpoint is that copy, and rerunning the same way would fail the same way.

Cost: the reward/advantage/loss flags ride on the all-reduce that already decides whether to skip the step; the
parameter check is two passes over this rank's own shards (no gather) and one all-reduce of two numbers per
optimizer step. Sums over every rank's shards give the global norm under FSDP (each rank holds a flat shard);
where parameters are replicated (DDP-like engines) every rank adds the same sum, which leaves the ratio unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_dist import distributed as gdist

NONFINITE_EXIT_CODE = 3  # too many non-finite steps in a row: rerunning the same way would fail the same way
CAUSES = ("reward", "advantage", "loss", "gradient")  # the order in which one is named when several are seen
PARAMETER_GROWTH_LIMIT = 10.0  # a healthy step changes the weights by a few % (lr / init std); 10x is breakage
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps were not finite (reward, advantage, loss or gradient), or an update made the
    parameters non-finite or blew them up."""


@dataclass
class Votes:
    """One step's non-finite votes, in one place: this rank's reward / advantage flags (set once the advantages
    exist), each reward function's largest |weight x score| (max-reduced over ranks at the vote, named in the
    message), and the cause the vote found."""
    flags: dict = field(default_factory=dict)
    peaks: list[float] = field(default_factory=list)
    cause: str | None = None

    def vote(self, loss_nonfinite: bool, device) -> str | None:
        """The cause (CAUSES) seen on any rank before an optimizer step, or None: one all-reduce of the flags and
        the peaks. Collective."""
        votes = gdist.all_reduce_max([float(loss_nonfinite), float(self.flags.get("reward", False)),
                                      float(self.flags.get("advantage", False)), *self.peaks], device)
        self.peaks = [float(v) for v in votes[3:]]
        return first_cause({"loss": votes[0] > 0, "reward": votes[1] > 0, "advantage": votes[2] > 0})


def precision_advice(cfg) -> str:
    """The override that turns mixed precision off, as the config parser reads it (YAML null), when it is on."""
    return ", or train in full precision: distributed.mixed_precision=null" if cfg.distributed.mixed_precision \
        else ""


def reward_peaks(per_function: dict, names: list, weights: list) -> list[float]:
    """max |weight x score| of each reward function over this rank's completions (0.0 without any), in `names`
    order: every rank passes the same names, so the values can be max-reduced."""
    out = []
    for name, w in zip(names, weights):
        scores = per_function.get(name) or [0.0]
        out.append(max(abs(float(w) * float(s)) if math.isfinite(float(w) * float(s)) else math.inf
                       for s in scores))
    return out


def local_flags(rewards: torch.Tensor, advantages: torch.Tensor) -> dict:
    """{cause: bool} of the rewards and advantages of this rank's rows."""
    bad_rewards = not bool(torch.isfinite(rewards).all())
    return {"reward": bad_rewards, "advantage": not bad_rewards and not bool(torch.isfinite(advantages).all())}


def first_cause(flags: dict) -> str | None:
    return next((c for c in CAUSES if flags.get(c)), None)


def describe(cause: str, names: list, peaks: list[float], scale_rewards: str) -> str:
    """What went non-finite, for the stop message."""
    if cause == "reward":
        k = max(range(len(peaks)), key=lambda i: peaks[i]) if peaks else None
        who = f" from reward function '{names[k]}' (|weight x reward| up to {peaks[k]:.3g})" if k is not None else ""
        return f"non-finite rewards{who}: rewards must be finite and of moderate size (they train in float32)"
    if cause == "advantage":
        why = " (scale_rewards=none keeps the rewards' scale: rewards must be of moderate size)" \
            if scale_rewards == "none" else " (with finite rewards: a non-finite KL penalty of kl_in_reward?)"
        return f"non-finite advantages{why}"
    if cause == "gradient":
        return "a NaN/inf gradient norm (the loss was finite)"
    return "a NaN/inf loss"


def advice(cause: str, precision_advice: str) -> str:
    if cause in ("reward", "advantage"):
        return "Fix the reward function (or its weight) so that every reward is a moderate number"
    return f"Lower learning_rate, check the data{precision_advice}"


def checkpoint_note(output_dir: str | Path) -> str:
    """The newest complete checkpoint, or that there is none (the steps that stopped the run are in no checkpoint:
    a skipped step changes nothing, and the parameter check stops before any save)."""
    from grpo_dist.checkpoint import latest_checkpoint
    try:
        latest = latest_checkpoint(output_dir)
    except OSError:
        latest = None
    if latest is None:
        return f"There is no checkpoint in {output_dir}"
    return f"The newest checkpoint, {latest}, holds the weights from before these steps"


def parameter_norm_sq(params: list[torch.Tensor]) -> float:
    """Sum of squares of these (local) tensors, in float64: one device sync. inf/nan if any element is. A ZeRO-3
    parameter is an empty placeholder: its local partition (ds_tensor) counts instead."""
    local = [getattr(p, "ds_tensor", None) for p in params]
    norms = [torch.linalg.vector_norm((p if t is None else t).detach(), dtype=torch.float64)
             for p, t in zip(params, local)]
    return float(torch.stack(norms).pow(2).sum()) if norms else 0.0


def parameter_problem(before_sq: float, after_sq: float) -> str | None:
    """None when the update is sane; else what is wrong with the parameters after it."""
    if not math.isfinite(after_sq):
        return "the parameters became non-finite (NaN/inf)"
    if before_sq > 0 and after_sq > before_sq * PARAMETER_GROWTH_LIMIT ** 2:
        return (f"the parameters' norm grew {math.sqrt(after_sq / before_sq):.3g}x in one update (from "
                f"{math.sqrt(before_sq):.3g} to {math.sqrt(after_sq):.3g}; more than {PARAMETER_GROWTH_LIMIT:g}x "
                f"is taken as a diverged update)")
    return None

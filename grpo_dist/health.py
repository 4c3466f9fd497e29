"""Training-health monitor: every step, on the step's already all-reduced metrics (step_metrics.py), it
tells whether the run is learning, and says so on the console when it stops learning.

No collective: every rank sees the same all-reduced numbers, so every rank reaches the same verdict (the same
`health/<name>` values, the same stop decision); only rank 0 prints. Each condition prints one line when it starts
(what it means, what to change: the words of docs/troubleshooting.md) and one when it ends, and logs
`health/<name>` (0/1) into the step's metrics. Conditions named in health.stop_on stop the run with
CANNOT_LEARN_EXIT_CODE (after a checkpoint, when saving is configured).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

HISTORY = 100  # steps of metrics the monitor keeps (a long run must not grow it without bound)
CANNOT_LEARN_EXIT_CODE = 5  # the run cannot learn (health.stop_on, or a failed --dry-run verdict)

# name -> (what it means, what to change), from docs/troubleshooting.md
CONDITIONS: dict[str, tuple[str, str]] = {
    "reward_constant": (
        "every completion gets the same reward: no learning signal",
        "reward 0 everywhere: raise max_completion_length (check truncated_fraction), fix the prompt template so "
        "the model writes the format the reward reads, test the reward function by hand; reward 1 everywhere: "
        "harder data"),
    "zero_advantage": (
        "every completion of a group gets the same reward: no learning signal (loss and gradient are 0)",
        "raise max_completion_length if answers are cut off, raise temperature if groups are near-identical, "
        "check the reward function"),
    "truncated": (
        "answers are cut off at max_completion_length, so they cannot be graded",
        "raise max_completion_length, or ask for shorter reasoning in the prompt"),
    "length_collapse": (
        "the model learned that answering nothing is never worse (only EOS)",
        "check the reward gives 0 for empty answers; try loss_type: dr_grpo and scale_rewards: none; lower "
        "learning_rate"),
    "entropy_collapse": (
        "the policy collapses onto a few outputs (low entropy predicts mode collapse); exploration is gone",
        "stop at the last good checkpoint; epsilon_high: 0.28 (clip-higher), more num_generations, lower "
        "learning_rate, a small beta"),
    "grad_norm_jump": (
        "updates too large for the current policy (a sudden rise often precedes instability)",
        "lower learning_rate, add warmup_steps, keep clipping on (max_grad_norm)"),
    "kl_high": (
        "the policy drifts from the reference faster than the penalty holds it",
        "lower learning_rate; on math beta: 0 is usually better"),
    "nonfinite": (
        "numerical blow-up: the step was skipped (skipped_steps rose) or a metric is NaN/inf",
        "lower learning_rate, keep max_grad_norm: 1.0, use bf16 (not fp16) with float32 master weights"),
}


@dataclass
class Verdict:
    """One step's outcome: health/<name> values, the lines to print (rank 0), the first active stop_on name."""
    flags: dict[str, int]
    lines: list[str]
    stop: str | None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _num(m: dict, key: str) -> float | None:
    """m[key] as a float when it is a finite number, else None."""
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


class HealthMonitor:
    """Conditions on a sequence of step metrics; cfg is a config.HealthConfig, max_completion_length the cap."""

    def __init__(self, cfg, max_completion_length: int, beta: float = 0.0, completions_per_step: int | None = None,
                 grad_norm_per_signal: bool = True):
        """completions_per_step: of the whole step (all ranks), for reward_constant's stop (None: patience only);
        grad_norm_per_signal: the gradient norm scales with the fraction of groups whose rewards differ (flat groups
        add zero gradient but count in the loss's normaliser), so grad_norm_jump compares norm / that fraction;
        false with skip_zero_advantage_groups, whose normaliser leaves the flat groups out."""
        self.cfg = cfg
        self.max_completion_length = max_completion_length
        self.beta = beta
        self.completions_per_step = completions_per_step
        self.grad_norm_per_signal = grad_norm_per_signal
        self.active: dict[str, int] = {}  # name -> the step it started
        self._run: dict[str, int] = {}  # consecutive steps a patience condition held
        self._hist: dict[str, list[float]] = {"completion_length_mean": [], "entropy": [], "grad_norm": [],
                                              "reward_mean": []}
        self._skipped: int | None = None
        self._grad_median = 0.0
        self._start: dict[str, float] = {}  # median of the first min_history steps: where the run started
        self.history: list[dict] = []  # the last HISTORY steps' metrics (with health/*): the dry run reads them

    def _started_above(self, key: str, floor: float) -> bool:
        """Whether key's first min_history steps had a median >= floor: an absolute floor flags a fall below it,
        not a run that starts there (a 9-token answer task, an instruct model's low entropy at temperature 0.7)."""
        return self._start.get(key, -math.inf) >= floor

    def _median(self, key: str) -> float | None:
        h = self._hist[key][-self.cfg.window:]
        return statistics.median(h) if len(h) >= self.cfg.min_history else None

    def _reward_gain(self, m: dict) -> bool:
        """Whether the run is learning by its reward: the mean of the last min_history rewards (this step's
        included) is above the run's start by a quarter (and 0.01), and not half under its running median. While it
        is, a falling length or entropy is the policy sharpening (a base model that stops rambling, an instruct
        model growing sure of its answer line), not a collapse: those conditions then hold their alarm."""
        r = _num(m, "reward_mean")
        start, med = self._start.get("reward_mean"), self._median("reward_mean")
        if r is None or start is None or med is None:
            return False
        recent = self._hist["reward_mean"][-(self.cfg.min_history - 1):] + [r]
        now = sum(recent) / len(recent)
        return now > start + 0.25 * abs(start) + 0.01 and now >= med - 0.5 * abs(med)

    def _persist(self, name: str, now: bool) -> bool:
        """A condition that must hold patience steps in a row."""
        self._run[name] = self._run.get(name, 0) + 1 if now else 0
        return self._run[name] >= self.cfg.patience

    def conditions(self, m: dict) -> dict[str, bool]:
        """Which conditions hold at this step (reads m, then adds its values to the running medians)."""
        c = self.cfg
        reward = m.get("reward_mean")
        out = {
            "reward_constant": self._persist("reward_constant", _finite(reward) and reward in (0.0, 1.0)
                                             and m.get("reward_std", 0.0) == 0.0),
            "zero_advantage": self._persist("zero_advantage",
                                            m.get("zero_advantage_fraction", 0.0) > c.zero_advantage_max),
            "truncated": m.get("truncated_fraction", 0.0) > c.truncated_max,
        }
        gain = self._reward_gain(m)  # a learning run: falls in length and entropy are sharpening
        length, med = _num(m, "completion_length_mean"), self._median("completion_length_mean")
        # below the floor counts where the cap leaves room for 4x the floor (a cap of 8 keeps answers short) and the
        # run started above it: only EOS is a collapse whatever the reward says
        floor = c.min_completion_length if self.max_completion_length >= 4 * c.min_completion_length and \
            self._started_above("completion_length_mean", c.min_completion_length) else 0.0
        out["length_collapse"] = length is not None and (length < floor or (
            not gain and med is not None and length * c.length_fall_factor < med))
        ent, med = _num(m, "entropy"), self._median("entropy")
        trained = m.get("trained_tokens", 1.0) > 0  # no trained token: entropy reads 0 and means nothing
        out["entropy_collapse"] = ent is not None and trained and not gain and (
            (ent < c.entropy_min and self._started_above("entropy", c.entropy_min)) or
            (med is not None and ent * c.entropy_fall_factor < med))
        gn, med = self._grad_signal(m), self._median("grad_norm")
        self._grad_median = med or 0.0
        out["grad_norm_jump"] = gn is not None and med is not None and med > 0 and gn > c.grad_norm_jump_factor * med
        kl = _num(m, "kl")
        out["kl_high"] = self.beta > 0 and kl is not None and kl > c.kl_max
        skipped = m.get("skipped_steps", 0)
        rose = self._skipped is not None and skipped > self._skipped
        self._skipped = skipped
        keys = ("reward_mean", "loss", "grad_norm", "kl", "entropy")
        out["nonfinite"] = rose or any(k in m and not _finite(m[k]) for k in keys)
        for key in self._hist:
            value = self._grad_signal(m) if key == "grad_norm" else _num(m, key)
            if value is not None and not (key == "grad_norm" and value == 0.0) and \
                    not (key == "entropy" and not trained):
                h = self._hist[key]
                h.append(value)
                if len(h) == c.min_history and key not in self._start:
                    self._start[key] = statistics.median(h)
                del h[:-max(c.window, c.min_history)]  # bounded: the medians read the last window steps
        return out

    def _grad_signal(self, m: dict) -> float | None:
        """The gradient norm per unit of learning signal (grad_norm_per_signal): grad_norm / the fraction of groups
        whose rewards differ. A run whose rewards get less sparse (groups flat 95 % -> 43 %) sees its grad norm rise
        ~10x (0.03 -> 0.32) with nothing unstable: this ratio stays level, a real blow-up still jumps."""
        gn = _num(m, "grad_norm")
        if gn is None or not self.grad_norm_per_signal:
            return gn
        signal = 1.0 - float(_num(m, "zero_advantage_fraction") or 0.0)
        return gn / signal if signal > 0 else None  # no group with a signal: a zero-advantage step, no gradient

    def _stop(self) -> str | None:
        """The first active stop_on condition; reward_constant only once reward_constant_min_completions
        completions in a row scored the same (a rare success is then unlikely to have been missed: 1 % per
        completion gives 459 failures in a row with probability 0.99^459 < 1 %)."""
        for name in self.cfg.stop_on:
            if name not in self.active:
                continue
            if name == "reward_constant" and self.completions_per_step:
                held = self._run.get("reward_constant", 0)
                if held * self.completions_per_step < self.cfg.reward_constant_min_completions:
                    continue
            return name
        return None

    def update(self, m: dict, step: int, skipped: tuple[str, str] | None = None) -> Verdict:
        """This step's verdict; m is the step's all-reduced metrics dict (identical on every rank). `skipped`: the
        non-finite guard's (what, advice) when it skipped this step: the nonfinite line then names the cause (a
        reward function's enormous scores are not the learning rate's fault) instead of the generic advice."""
        flags: dict[str, int] = {}
        lines: list[str] = []
        if not self.cfg.enabled:
            return Verdict(flags, lines, None)
        for name, now in self.conditions(m).items():
            flags[f"health/{name}"] = int(now)
            if now and name not in self.active:
                self.active[name] = step
                means, change = CONDITIONS[name]
                if name == "nonfinite" and skipped is not None:
                    means, change = f"the step was skipped: {skipped[0]}", skipped[1][:1].lower() + skipped[1][1:]
                lines.append(f"[grpo_dist] health: {name} from step {step} ({self._numbers(name, m)}): {means}; "
                             f"{change}")
            elif not now and name in self.active:
                start = self.active.pop(name)
                lines.append(f"[grpo_dist] health: {name} ended at step {step} (held {step - start} step(s) from step "
                             f"{start})")
        stop = self._stop()
        self.history = self.history[-(HISTORY - 1):] + [{**m, **flags}]
        return Verdict(flags, lines, stop)

    def _numbers(self, name: str, m: dict) -> str:
        """The numbers behind the condition, with its threshold."""
        c = self.cfg

        def g(k):
            v = m.get(k)
            return f"{v:.4g}" if isinstance(v, float) else str(v)
        return {
            "reward_constant": f"reward_mean={g('reward_mean')}, reward_std=0 for {c.patience} steps",
            "zero_advantage": f"zero_advantage_fraction={g('zero_advantage_fraction')} > {c.zero_advantage_max} "
                              f"for {c.patience} steps",
            "truncated": f"truncated_fraction={g('truncated_fraction')} > {c.truncated_max} at "
                         f"max_completion_length={self.max_completion_length}",
            "length_collapse": f"completion_length_mean={g('completion_length_mean')}, below "
                               f"{c.min_completion_length} or {c.length_fall_factor:g}x under its running median",
            "entropy_collapse": f"entropy={g('entropy')}, below {c.entropy_min} or {c.entropy_fall_factor:g}x "
                                f"under its running median",
            "grad_norm_jump": f"grad_norm={g('grad_norm')}, per fraction of groups with a signal "
                              f"{self._grad_signal(m) or 0.0:.4g} > {c.grad_norm_jump_factor:g}x its running median "
                              f"{self._grad_median:.4g}" if self.grad_norm_per_signal else
                              f"grad_norm={g('grad_norm')} > {c.grad_norm_jump_factor:g}x its running median "
                              f"{self._grad_median:.4g}",
            "kl_high": f"kl={g('kl')} > {c.kl_max}",
            "nonfinite": f"skipped_steps={g('skipped_steps')}, loss={g('loss')}, grad_norm={g('grad_norm')}",
        }[name]

"""`python -m grpo_dist.train --config X.yaml --dry-run` (or dry_run=true): a rehearsal of the config in seconds.

The config as given, except num_generations=2, 8 prompts in all (prompts_per_rank = ceil(8 / ranks)), 2 steps,
no evaluation, no checkpoint, no resume, output in a temporary directory (removed afterwards; the configured
output_dir is never read nor written). It prints the run table, one completion per prompt with its reward (rank
0's prompts), the fraction cut off at max_completion_length, the fraction of groups with one reward, whether the
gradient was non-zero, the step time and peak memory, and a verdict line. Exit 0: can learn (some group's rewards
differed and the gradient was non-zero: a learning signal, for certain); exit 5 (health.CANNOT_LEARN_EXIT_CODE):
cannot, the verdict says why and what to change; exit 6 (CANNOT_TELL_EXIT_CODE): cannot tell yet.

"Cannot tell yet" is the verdict when every completion scored 0 (or every one 1): 16 groups of 2 are too few to
tell a config that never succeeds from one that rarely does. If a completion scores with probability p, all m of
them score 0 with probability (1 - p)^m: for m = 32, 19 % at p = 5 %, 52 % at p = 2 %. So the rehearsal only bounds
p: below 1 - 0.05^(1/m) (8.9 % for m = 32) with 95 % confidence, and the verdict says so rather than "cannot
learn", which it would be wrong to say that often (issue 39: ~20 % of rehearsals at 5 % base accuracy).
"""

from __future__ import annotations

import math
import os
import resource
import tempfile
from pathlib import Path

from grpo_dist.health import CANNOT_LEARN_EXIT_CODE

DRY_RUN_PROMPTS = 8
DRY_RUN_STEPS = 2
DRY_RUN_GENERATIONS = 2
CANNOT_TELL_EXIT_CODE = 6  # every completion scored the same 0 or 1: too few groups to say either way
CONFIDENCE = 0.95  # of the bound the "cannot tell yet" verdict states


def dry_run_dir(world_size: int) -> Path:
    """One temporary directory that every rank of the job names alike (under torchrun they share their parent, the
    elastic agent)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    owner = os.getppid() if world_size > 1 else os.getpid()
    return Path(tempfile.gettempdir()) / "_".join(x for x in ("grpo_dist_dry_run", run, str(owner)) if x)


def prepare(cfg, world_size: int):
    """The dry run's config from the user's."""
    from grpo_dist.config import load_config
    d = cfg.to_dict()
    d.update(num_generations=DRY_RUN_GENERATIONS, prompts_per_rank=math.ceil(DRY_RUN_PROMPTS / world_size),
             max_steps=DRY_RUN_STEPS, save_steps=0, save_final=False, save_best=None, eval_steps=0, full_eval_steps=0,
             eval_num_samples=0, full_eval_num_samples=0, resume_from_checkpoint=None,
             overwrite_output_dir=False, output_dir=str(dry_run_dir(world_size)), log_completions=0,
             progress_bar=False, report_to=[], warmup_steps=0, dry_run=True)
    d["health"] = {**d["health"], "stop_on": []}
    # groups of 2: no room for group size by difficulty (its range would be refused around num_generations=2)
    d["curriculum"] = {**d["curriculum"], "num_generations_min": None, "num_generations_max": None}
    return load_config(None, base=d)


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class DryRun:
    """Attached to the trainer: keeps rank 0's first-step completions, then reads the verdict from the monitor's
    history (all-reduced metrics: every rank returns the same code)."""

    def __init__(self, trainer, given):
        """given: the config as the user wrote it; its run table is printed (rank 0) before the rehearsal."""
        self.trainer = trainer
        self.given_generations = given.num_generations  # the full run's group size
        self.samples: list[tuple[str, float]] = []
        trainer.on_graded = self._graded
        if trainer.ctx.is_main:
            from grpo_dist.run_table import run_table
            lines = run_table(given, trainer.ctx.world_size, trainer.ref_model is not None)
            lines[0] = (f"[grpo_dist] run table (the run as configured; this dry run: {DRY_RUN_PROMPTS} prompts, "
                        f"num_generations={DRY_RUN_GENERATIONS}, {DRY_RUN_STEPS} steps, no checkpoint, output in "
                        f"{trainer.cfg.output_dir}, removed at the end):")
            print("\n".join(lines), flush=True)

    def _graded(self, batch, rewards) -> None:
        if self.samples or not self.trainer.ctx.is_main:
            return
        G = self.trainer.cfg.num_generations
        self.samples = [(batch.completions[i], float(rewards[i])) for i in range(0, len(rewards), G)]

    def verdict(self) -> tuple[str | None, dict]:
        """(None when the run can learn, else the reason; the summary numbers). A reason starting "cannot tell
        yet" is not a failure of the config, only of the rehearsal's size (the module docstring's formula)."""
        cfg, hist = self.trainer.cfg, self.trainer.health.history
        n = max(len(hist), 1)
        s = {"truncated": sum(m["truncated_fraction"] for m in hist) / n,
             "flat": sum(m["zero_advantage_fraction"] for m in hist) / n,
             "grad": any(m.get("grad_norm", 0.0) > 0 and math.isfinite(m["grad_norm"]) for m in hist),
             "rewards": sorted({m["reward_mean"] for m in hist}),
             "constant": all(m.get("reward_std", 1.0) == 0.0 for m in hist),
             "completions": len(hist) * cfg.prompts_per_rank * self.trainer.ctx.world_size * cfg.num_generations,
             "step_time": sum(m.get("step_time_s", 0.0) for m in hist) / n,
             "skipped": max((m.get("skipped_steps", 0) for m in hist), default=0)}
        if not hist:
            return "no step ran", s
        if s["flat"] >= 1.0:
            return self._flat_reason(s), s
        if s["skipped"]:
            return f"{s['skipped']} step(s) skipped for non-finite values: lower learning_rate", s
        if not s["grad"]:
            hint = ": mask_truncated_completions removed every cut-off row" if cfg.mask_truncated_completions \
                else ""
            return f"the gradient was zero in every step{hint}", s
        return None, s

    def _flat_reason(self, s: dict) -> str:
        """Why every group had one reward: "cannot tell yet" when every completion scored 0 (or 1), with the bound
        on the success rate it shows; else "cannot learn" reasons."""
        cfg, m = self.trainer.cfg, s["completions"]
        cut = (f"{s['truncated']:.0%} of completions were cut off at max_completion_length="
               f"{cfg.max_completion_length} tokens: raise max_completion_length") \
            if s["truncated"] > cfg.health.truncated_max else ""
        if s["constant"] and s["rewards"] in ([0.0], [1.0]):
            value = s["rewards"][0]
            bound = 1 - (1 - CONFIDENCE) ** (1 / m)  # the p at which all m fail (succeed) with probability 5 %
            rate = f"below {bound:.1%}" if value == 0.0 else f"above {1 - bound:.1%}"
            what = "succeed" if value == 0.0 else "fail"
            advice = cut or ("check the reward function and the prompt format on the completions above" if
                             value == 0.0 else "the data may be too easy for this model")
            return (f"cannot tell yet: all {m} completions scored {value:g}; if a completion could {what} with "
                    f"probability p, all {m} would score {value:g} with probability (1-p)^{m} ({0.95 ** m:.0%} at "
                    f"p = 5%), so this only shows that the success rate is {rate} ({CONFIDENCE:.0%} confidence). "
                    f"A full run with num_generations={self.given_generations} may still learn; the health monitor "
                    f"says so if it does not. {advice[0].upper()}{advice[1:]}")
        why = "every group had one reward"
        if cut:
            return f"{why}: {cut}"
        if s["constant"] and len(s["rewards"]) == 1:
            return f"{why}: every completion scored {s['rewards'][0]:g}: check the reward function"
        return f"{why}: groups are near-identical: raise temperature"

    def finish(self, code: int) -> int:
        """Print the report (rank 0); the exit code: code when the run itself failed, else the verdict's."""
        reason, s = self.verdict()
        if self.trainer.ctx.is_main:
            cfg = self.trainer.cfg
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            out = [f"[grpo_dist] dry run: {DRY_RUN_STEPS} steps, {DRY_RUN_PROMPTS} prompts, num_generations="
                   f"{cfg.num_generations}; one completion per prompt (step 1, rank 0):"]
            out += [f"[grpo_dist]   prompt {i + 1}: reward {r:.3g}: {_short(c)!r}" for i, (c, r) in
                    enumerate(self.samples)]
            out += [f"[grpo_dist] dry run: cut off at max_completion_length={cfg.max_completion_length}: "
                    f"{s['truncated']:.0%}; groups with one reward: {s['flat']:.0%}; gradient non-zero: "
                    f"{'yes' if s['grad'] else 'no'}; step time {s['step_time']:.2f} s; peak memory (RSS, rank 0) "
                    f"{peak_mb:.0f} MiB",
                    "[grpo_dist] dry run verdict: " + self._verdict_line(reason, s)]
            print("\n".join(out), flush=True)
        if code != 0:
            return code
        return 0 if reason is None else CANNOT_TELL_EXIT_CODE if reason.startswith("cannot tell yet") \
            else CANNOT_LEARN_EXIT_CODE

    @staticmethod
    def _verdict_line(reason: str | None, s: dict) -> str:
        if reason is None:
            return (f"can learn: {1 - s['flat']:.0%} of the groups had rewards that differ, so the gradient is not "
                    f"zero: the run gets a learning signal (exit 0)")
        if reason.startswith("cannot tell yet"):
            return f"{reason} (exit {CANNOT_TELL_EXIT_CODE})"
        return f"cannot learn: {reason} (exit {CANNOT_LEARN_EXIT_CODE})"

"""`python -m grpo_dist.train --config X.yaml --dry-run` (or dry_run=true): a rehearsal of the config in seconds.

The config as given, except num_generations=2, 8 prompts in all (prompts_per_rank = ceil(8 / ranks)), 2 steps,
no evaluation, no checkpoint, no resume, output in a temporary directory (removed afterwards; the configured
output_dir is never read nor written). It prints the run table, one completion per prompt with its reward (rank
0's prompts), the fraction cut off at max_completion_length, the fraction of groups with one reward, whether the
gradient was non-zero, the step time and peak memory, and a verdict line. Exit 0: can learn; exit 5
(health.CANNOT_LEARN_EXIT_CODE): cannot, the verdict says why and what to change.
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
        """(None when the run can learn, else the reason; the summary numbers)."""
        cfg, hist = self.trainer.cfg, self.trainer.health.history
        n = max(len(hist), 1)
        s = {"truncated": sum(m["truncated_fraction"] for m in hist) / n,
             "flat": sum(m["zero_advantage_fraction"] for m in hist) / n,
             "grad": any(m.get("grad_norm", 0.0) > 0 and math.isfinite(m["grad_norm"]) for m in hist),
             "rewards": sorted({m["reward_mean"] for m in hist}),
             "step_time": sum(m.get("step_time_s", 0.0) for m in hist) / n,
             "skipped": max((m.get("skipped_steps", 0) for m in hist), default=0)}
        if not hist:
            return "no step ran", s
        if s["flat"] >= 1.0:
            why = "every group had one reward"
            if s["truncated"] > cfg.health.truncated_max:
                return (f"{why}: {s['truncated']:.0%} of completions were cut off at max_completion_length="
                        f"{cfg.max_completion_length} tokens: raise max_completion_length"), s
            if s["rewards"] == [0.0]:
                return (f"{why}: every reward was 0: check the reward function and the prompt format on the "
                        f"completions above"), s
            if s["rewards"] == [1.0]:
                return f"{why}: every reward was 1: use harder data", s
            return f"{why}: groups are near-identical: raise temperature", s
        if s["skipped"]:
            return f"{s['skipped']} step(s) skipped for non-finite values: lower learning_rate", s
        if not s["grad"]:
            hint = ": mask_truncated_completions removed every cut-off row" if cfg.mask_truncated_completions \
                else ""
            return f"the gradient was zero in every step{hint}", s
        return None, s

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
                    "[grpo_dist] dry run verdict: " + ("can learn" if reason is None else
                                                       f"cannot learn: {reason} (exit {CANNOT_LEARN_EXIT_CODE})")]
            print("\n".join(out), flush=True)
        if code != 0:
            return code
        return 0 if reason is None else CANNOT_LEARN_EXIT_CODE

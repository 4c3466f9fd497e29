"""Metric sinks on rank 0: stdout (and a tqdm bar), output_dir/metrics.jsonl, TensorBoard, optional wandb."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

# The keys printed on the console line, in order (everything goes to the JSONL file).
CONSOLE_KEYS = ("reward_mean", "accuracy", "completion_length_mean", "loss", "kl", "entropy", "clip_fraction",
                "grad_norm", "step_time_s", "completion_tokens_per_s")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def drop_steps_after(path: Path, step: int) -> None:
    """Remove the lines of steps > `step` (logged by a run that crashed after its last checkpoint)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except ValueError:
            continue  # a line cut short by the crash
        kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(path)


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, report_to: list[str], config: dict | None = None,
                 max_steps: int = 0, progress_bar: bool = True, logging_steps: int = 1, start_step: int = 0,
                 resuming: bool | None = None):
        self.enabled = enabled
        self.logging_steps = logging_steps
        self._jsonl = self._tb = self._wandb = self._bar = None
        self._last_eval = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            path = out / "metrics.jsonl"
            # A resumed run redoes the steps after its checkpoint: log them once. Also at step 0: an auto-resume
            # that found no checkpoint (or started over) redoes every step of the run before it.
            if start_step > 0 if resuming is None else resuming:
                drop_steps_after(path, start_step)
            self._jsonl = open(path, "a", buffering=1)
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))
            except ImportError:
                print("[grpo_dist] report_to has tensorboard but the tensorboard package is missing "
                      "(pip install tensorboard); skipping it", file=sys.stderr)
        if "wandb" in report_to:
            try:
                import wandb
                # WANDB_PROJECT / WANDB_MODE=offline etc. are honoured; the run is named after output_dir.
                self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo_dist"), name=out.resolve().name,
                                         dir=str(out), config=config or {}, resume="allow")
            except ImportError:
                print("[grpo_dist] report_to has wandb but wandb is not installed; skipping it", file=sys.stderr)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=max_steps, initial=start_step, desc="GRPO", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        clean.setdefault("time", time.time())
        if self._jsonl:
            self._jsonl.write(json.dumps(clean) + "\n")
        step = metrics.get("step", 0)
        if self._tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k.replace("eval_", "eval/"), v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            post = dict(reward=f"{metrics.get('reward_mean', 0.0):.3f}",
                        step_s=f"{metrics.get('step_time_s', 0.0):.2f}")
            if self._last_eval is not None or "eval_accuracy" in metrics:
                self._last_eval = metrics.get("eval_accuracy", self._last_eval)
                post["eval_acc"] = f"{self._last_eval:.3f}"
            self._bar.set_postfix(post)
        if step % self.logging_steps == 0 or "eval_accuracy" in metrics or "eval_full_accuracy" in metrics:
            line = " ".join(f"{k}={_fmt(metrics[k])}" for k in ("step",) + CONSOLE_KEYS + ("eval_accuracy",
                                                                                           "eval_full_accuracy")
                            if k in metrics)
            (self._bar.write if self._bar is not None else print)(line)
            sys.stdout.flush()

    def write(self, text: str) -> None:
        """A free-form console message on rank 0 (through the progress bar when there is one)."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)
            sys.stdout.flush()

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()

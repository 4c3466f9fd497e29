"""Metric sinks on rank 0: stdout (and a tqdm bar), output_dir/metrics.jsonl, TensorBoard, optional wandb."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from grpo_dist.write_errors import describe_write_failure

# The keys printed on the console line, in order (everything goes to the JSONL file).
CONSOLE_KEYS = ("reward_mean", "accuracy", "completion_length_mean", "loss", "kl", "entropy", "clip_fraction",
                "grad_norm", "step_time_s", "completion_tokens_per_s")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class MetricsWriteError(RuntimeError):
    """Appending a step's line to metrics.jsonl failed for the disk's reasons (full disk, quota, I/O error); the
    line was not written and the file ends with the previous whole line. Raised on every rank (exit 2)."""


def cut_partial_tail(path: Path) -> int:
    """Truncate a last line cut short (no newline: a crash or full disk mid-write, before whole-line writes) so
    that appended lines start on a line of their own; returns the bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        pos = size
        while pos > 0:  # back to the last newline, a block at a time
            start = max(0, pos - 65536)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                pos = start + nl + 1
                break
            pos = start
        if pos < size:
            f.truncate(pos)
    return size - pos


def next_free(path: Path) -> Path:
    """path.1, path.2, ...: the first that does not exist (where a resume keeps the rows it replaces)."""
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def drop_steps_after(path: Path, step: int) -> tuple[list[int], Path | None]:
    """Remove the lines of steps > `step` (logged by a run that stopped after its last checkpoint: a resume
    replays those steps). Nothing is lost: when a line goes, the file as it was is kept as path.N first. Returns
    (the dropped steps, that copy or None)."""
    if not path.is_file():
        return [], None
    kept, dropped, partial = [], [], False
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:
            partial = True  # a line cut short by a crash
            continue
        if isinstance(row_step, int) and row_step > step:
            dropped.append(row_step)
            continue
        kept.append(line)
    if not dropped and not partial:
        return [], None
    copy = next_free(path)
    try:
        os.link(path, copy)  # the old inode: replacing path below leaves the copy as it was
    except OSError:
        shutil.copyfile(path, copy)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(path)
    return sorted(set(dropped)), copy


def append_whole(fd: int, data: bytes, path: Path) -> str | None:
    """Append data (whole lines) to the file open at fd (O_APPEND), all or nothing: on a failed write (full disk,
    quota, I/O error) the file is cut back to its size before, and the reason is returned (None: written). A bug
    (not a write error) propagates as itself."""
    before = os.fstat(fd).st_size
    try:
        done = 0
        while done < len(data):  # a short write on a filling disk: write the rest, or fail with ENOSPC
            done += os.write(fd, data[done:])
    except OSError as e:
        reason = describe_write_failure(e, path)
        if reason is None:
            raise
        try:
            os.ftruncate(fd, before)
        except OSError:
            pass  # the reader then skips one unparsable line, and the next run cuts it (cut_partial_tail)
        return reason
    return None


def replay_line(name: str, step: int, dropped: list[int], copy: Path | None) -> str | None:
    """The one line a resume prints when it replays steps the run before had logged (None: none)."""
    if copy is None:
        return None
    if not dropped:
        return f"[grpo_dist] resume: {name} had a line cut short; the file as it was is kept as {copy.name}"
    steps = f"step {dropped[0]} (" if len(dropped) == 1 else f"steps {dropped[0]}-{dropped[-1]} ("
    verb = "is" if len(dropped) == 1 else "are"
    return (f"[grpo_dist] resume: {steps}logged by the run before, after its last checkpoint at step {step}) {verb} "
            f"replayed; {name} as it was, with their rows, is kept as {copy.name}")


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, report_to: list[str], config: dict | None = None,
                 max_steps: int = 0, progress_bar: bool = True, logging_steps: int = 1, start_step: int = 0,
                 resuming: bool | None = None):
        self.enabled = enabled
        self.logging_steps = logging_steps
        self._jsonl = self._tb = self._wandb = self._bar = None
        self._last_eval = None
        self.failed: str | None = None  # why appending to metrics.jsonl failed (full disk): the run stops on it
        self.path: Path | None = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            path = out / "metrics.jsonl"
            # A resumed run redoes the steps after its checkpoint: log them once. Also at step 0: an auto-resume
            # that found no checkpoint (or started over) redoes every step of the run before it.
            self.path = path
            if start_step > 0 if resuming is None else resuming:
                line = replay_line(path.name, start_step, *drop_steps_after(path, start_step))
                if line:
                    print(line, flush=True)
            elif path.is_file():
                cut_partial_tail(path)  # a half line left by a crash would glue itself to the next one
            # unbuffered, appending: each line is one os.write, and a failed one is cut back (log)
            self._jsonl = open(path, "ab", buffering=0)
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
        if self._jsonl and self.failed is None:
            self._append(json.dumps(clean) + "\n", metrics.get("step", 0))
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

    def _append(self, line: str, step) -> None:
        """One whole line or none: a failed write (full disk) is recorded in self.failed (the trainer stops every
        rank on it, exit 2); a bug propagates as itself."""
        assert self._jsonl is not None and self.path is not None
        reason = append_whole(self._jsonl.fileno(), line.encode(), self.path)
        if reason:
            self.failed = f"appending the line of step {step} to {self.path} failed: {reason}"

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

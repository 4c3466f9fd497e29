"""Training curves as PNG files, from OUTPUT_DIR/metrics.jsonl.

    python -m grpo_dist.tools.plot OUTPUT_DIR [--smoothing 0.8] [--out DIR]

Writes OUTPUT_DIR/plots/training_curves.png (all panels on one page) and one PNG per panel (reward.png,
eval_accuracy.png, completion_length.png, truncated.png, kl.png, entropy.png, clip_fraction.png, grad_norm.png,
tokens_per_s.png).
Each panel shows the raw per-step values faintly and an exponential moving average (the --smoothing weight, as in
TensorBoard) on top; the x axis is the optimizer step. A panel whose metric was never logged says so instead of
drawing an empty frame. When OUTPUT_DIR/eval_base.json exists (written by launch/demo.sh), its accuracy is drawn
as step 0 of the held-out accuracy panel. Needs matplotlib (`pip install matplotlib`, or `pip install -e .[plot]`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    file: str            # PNG name
    title: str
    ylabel: str          # with units
    series: tuple        # ((metric key, legend label), ...)
    note: str = ""       # how to read it (drawn under the title)
    ylim01: bool = False  # fractions: y axis 0..1
    smooth: bool = True   # eval points are sparse: no smoothing, markers


PANELS = (
    Panel("reward.png", "Reward (training rollouts)", "mean reward per completion",
          (("reward_mean", "reward"), ("accuracy", "fraction correct")),
          "should rise; flat at 0 or 1 = no learning signal"),
    Panel("eval_accuracy.png", "Held-out accuracy (greedy)", "fraction correct",
          (("eval_accuracy", "eval accuracy"),), "problems never trained on", ylim01=True, smooth=False),
    Panel("completion_length.png", "Completion length", "tokens per completion",
          (("completion_length_mean", "mean"), ("completion_length_max", "max")),
          "a sudden drop to ~1 = collapse to empty answers"),
    Panel("truncated.png", "Completions cut off (training rollouts)", "fraction that reached the length limit",
          (("truncated_fraction", "cut off"),), "falling = the model learns to stop", ylim01=True),
    Panel("kl.png", "KL to the reference (k3)", "nats per token", (("kl", "KL"),),
          "0 when beta = 0 (no reference model)"),
    Panel("entropy.png", "Token entropy of the policy", "nats per token", (("entropy", "entropy"),),
          "falling towards 0 = mode collapse; rising fast = noise"),
    Panel("clip_fraction.png", "PPO clip fraction", "fraction of tokens clipped", (("clip_fraction", "clipped"),),
          "0 with one update per batch (num_iterations = 1)", ylim01=False),
    Panel("grad_norm.png", "Gradient norm (before clipping)", "L2 norm", (("grad_norm", "grad norm"),),
          "spikes precede instability"),
    Panel("tokens_per_s.png", "Generation throughput", "completion tokens / s (per rank)",
          (("completion_tokens_per_s", "tokens/s"),), "sudden drops: memory pressure or contention"),
)


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of metrics.jsonl in step order; when a resumed run logged a step twice, the later row wins."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a training output_dir (with metrics.jsonl)")
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                print(f"[grpo_dist.tools.plot] {path}:{lineno}: not JSON, skipped (a run killed mid-write?)",
                      file=sys.stderr)
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def ema(values: list[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): s_t = w s_{t-1} + (1-w) x_t, divided by
    1 - w^t so that the first points are not pulled towards 0."""
    out, s, n = [], 0.0, 0
    for v in values:
        n += 1
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight ** n) if weight < 1 else v)
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _draw(ax, panel: Panel, rows: list[dict], smoothing: float) -> None:
    colors = ("tab:blue", "tab:orange", "tab:green")
    drawn = False
    for i, ((key, label), color) in enumerate(zip(panel.series, colors)):
        xs, ys = _series(rows, key)
        if not xs:
            continue
        drawn = True
        if panel.smooth and len(xs) > 2:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, ema(ys, smoothing), color=color, linewidth=2, linestyle="--" if i else "-",
                    label=f"{label} (smoothed)")
        else:
            ax.plot(xs, ys, color=color, marker="o", linewidth=2, label=label)
            for x, y in ((xs[0], ys[0]), (xs[-1], ys[-1])):
                ax.annotate(f"{y:.0%}" if panel.ylim01 else f"{y:.3g}", (x, y), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=9)
    ax.set_title(panel.title + (f"\n{panel.note}" if panel.note else ""), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if not drawn:
        keys = ", ".join(k for k, _ in panel.series)
        ax.text(0.5, 0.5, f"not logged ({keys})", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    if panel.ylim01:
        ax.set_ylim(-0.02, 1.05)
    ax.legend(fontsize=8, loc="best")


def plot(output_dir: str | Path, out_dir: str | Path | None = None, smoothing: float = 0.8) -> list[Path]:
    """Write the panels; returns the PNG paths (overview first)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    rows = read_metrics(output_dir)
    if not rows:
        raise ValueError(f"{output_dir}: metrics.jsonl has no rows with a 'step'")
    n_steps = len(rows)
    base = Path(output_dir) / "eval_base.json"  # the demo's evaluation of the model before training: step 0
    if base.is_file():
        try:
            rows.insert(0, {"step": 0, "eval_accuracy": float(json.loads(base.read_text())["accuracy"])})
        except (ValueError, KeyError, TypeError):
            pass
    out = Path(out_dir) if out_dir else Path(output_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(3, 3, figsize=(16, 12))
    for ax, panel in zip(axes.flat, PANELS):
        _draw(ax, panel, rows, smoothing)
    fig.suptitle(f"GRPO training: {Path(output_dir).resolve().name} ({n_steps} steps; faint = raw, bold = "
                 f"EMA smoothing {smoothing})", fontsize=13)
    fig.tight_layout()
    overview = out / "training_curves.png"
    fig.savefig(overview, dpi=90)
    plt.close(fig)
    written.append(overview)

    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _draw(ax, panel, rows, smoothing)
        fig.tight_layout()
        fig.savefig(out / panel.file, dpi=100)
        plt.close(fig)
        written.append(out / panel.file)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_dist.tools.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", help="training output_dir holding metrics.jsonl")
    p.add_argument("--out", help="where the PNGs go (default OUTPUT_DIR/plots)")
    p.add_argument("--smoothing", type=float, default=0.8, help="EMA weight in [0, 1); 0 = raw")
    args = p.parse_args(argv)
    try:
        paths = plot(args.output_dir, args.out, args.smoothing)
    except (FileNotFoundError, ValueError) as e:
        print(f"grpo_dist.tools.plot: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("grpo_dist.tools.plot: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} PNG files to {paths[0].parent} (overview: {paths[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

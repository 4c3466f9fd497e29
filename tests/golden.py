"""Golden trajectories: the first steps of the demo and of the smoke config, in float64, on 2 ranks, recorded.

    python -m tests.golden --record            # re-record every case (an intended behaviour change, same commit)
    python -m tests.golden --check [CASE ...]  # run and compare, printing the largest differences

Why float64: a float32 trajectory depends on the CPU's kernels (AVX2 and AVX-512 round differently in the last bit,
and a few steps amplify it: ../shared/notes/cpu-kernel-families.md); in float64 the same differences stay orders of
magnitude below TOLERANCE over these few steps, so one recording holds on any CPU. tests/test_golden.py compares a
fresh run with the recording, and checks that the same float32 command run twice gives bitwise identical metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "golden"
TOLERANCE = 1e-6  # |recorded - run| <= TOLERANCE * max(1, |recorded|), per value
RECORDED = ("loss", "reward_mean", "grad_norm", "eval_accuracy")  # per step (eval_accuracy: eval_steps=1)


def is_timing(metric: str) -> bool:
    """Wall-clock metrics (seconds, rates, the timestamp): the only ones two runs of one command may differ in."""
    return metric == "time" or metric.endswith("_s") or "_per_s_" in metric or metric.startswith("mfu")

COMMON = ["progress_bar=false", "report_to=[jsonl]", "save_steps=0", "save_final=false", "save_best=null",
          "eval_steps=1", "distributed.timeout_s=120"]
CASES = {
    # the demo: the shipped base model, its 2 ranks x 16 prompts x 8 completions, 20 of its 150 steps
    "demo": ("configs/demo_cpu.yaml", ["max_steps=20"]),
    # the smoke config: a random tiny Qwen2, beta 0.04 (a reference model), two reward functions in a grading worker
    "smoke": ("configs/smoke_cpu.yaml", ["max_steps=20", "data.eval_limit=16"]),
}


def command(case: str, out: Path, dtype: str = "float64") -> list[str]:
    config, extra = CASES[case]
    # rendezvous on a free port (c10d, localhost:0): tests run side by side
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", "-m", "grpo_dist.train", "--config", config, f"output_dir={out}",
            f"model.dtype={dtype}", *COMMON, *extra]


def run(case: str, out: Path, dtype: str = "float64") -> list[dict]:
    """The case on 2 ranks (gloo, 1 thread each) in `out`; every step's metrics, as metrics.jsonl has them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(command(case, out, dtype), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} ({dtype}) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trajectory(metrics: list[dict]) -> dict:
    return {k: [m[k] for m in metrics] for k in RECORDED}


def path(case: str) -> Path:
    return DATA / f"{case}.json"


def differences(case: str, got: dict) -> list[str]:
    """The recorded values of `case` that `got` misses by more than TOLERANCE (empty: it matches)."""
    want = json.loads(path(case).read_text())["trajectory"]
    bad = []
    for k in RECORDED:
        if len(got[k]) != len(want[k]):
            bad.append(f"{k}: {len(got[k])} steps, recorded {len(want[k])}")
            continue
        for step, (g, w) in enumerate(zip(got[k], want[k]), 1):
            if not (math.isfinite(g) and abs(g - w) <= TOLERANCE * max(1.0, abs(w))):
                bad.append(f"{k} at step {step}: {g!r}, recorded {w!r}")
    return bad


def largest_difference(case: str, got: dict) -> float:
    want = json.loads(path(case).read_text())["trajectory"]
    return max(abs(g - w) / max(1.0, abs(w)) for k in RECORDED for g, w in zip(got[k], want[k]))


def record(case: str, tmp: Path) -> None:
    import torch
    got = trajectory(run(case, tmp / case))
    DATA.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(command(case, Path("OUT"))[1:])
    path(case).write_text(json.dumps({
        "how": "python -m tests.golden --record (tests/golden.py); compared at TOLERANCE by tests/test_golden.py",
        "command": cmd, "torch": torch.__version__, "recorded_on": torch.backends.cpu.get_cpu_capability(),
        "trajectory": got}, indent=1) + "\n")
    print(f"[golden] {path(case).relative_to(ROOT)}: {len(got['loss'])} steps")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", action="store_true", help="run every case (or CASE ...) and write its recording")
    p.add_argument("--check", action="store_true", help="run and compare with the recording")
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"some of {', '.join(CASES)} (default: all)")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]}; choose from {', '.join(CASES)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        for case in args.cases or list(CASES):
            if args.record:
                record(case, Path(tmp))
            else:
                got = trajectory(run(case, Path(tmp) / case))
                bad = differences(case, got)
                failed += bool(bad)
                print(f"[golden] {case}: largest relative difference {largest_difference(case, got):.3g} "
                      f"({'OK' if not bad else 'FAIL: ' + '; '.join(bad[:5])})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Steps to a given demo accuracy with and without the online curriculum (config section `curriculum`).

Runs the built-in demo (configs/demo_cpu.yaml: the shipped 0.47 M-parameter base model learning two-number
addition, 2 CPU ranks under torchrun) once per (mode, seed) with a greedy evaluation on the 80 held-out problems
every --eval-steps steps, and reports the first evaluated step whose eval_accuracy reaches --target (null: not
reached within --max-steps). Each run takes ~75 s on a quiet 2-core CPU at 150 steps.

    nice -n 5 python bench/curriculum.py [--seeds 0 1 2] [--target 0.85] [--max-steps 150] [--eval-steps 10]
                                         [--modes none online online_sized]

The last line is one JSON object: {"target", "runs": {mode: {seed: steps or null}}, "median": {mode: ...},
"final_eval_accuracy": {mode: {seed: ...}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"none": ["curriculum.mode=none"],
         "online": ["curriculum.mode=online", "curriculum.window=2", "curriculum.retire_weight=0.1"],
         # group size by difficulty on top (not in the default --modes): 4..16 completions, 8 on average
         "online_sized": ["curriculum.mode=online", "curriculum.window=2", "curriculum.retire_weight=0.1",
                          "curriculum.num_generations_min=4", "curriculum.num_generations_max=16"]}
DEFAULT_MODES = ["none", "online"]


def run(mode: str, seed: int, args, out: str) -> tuple[int | None, float | None]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "-m", "grpo_dist.train",
           "--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), f"output_dir={out}", f"seed={seed}",
           f"max_steps={args.max_steps}", f"eval_steps={args.eval_steps}", "save_best=null", "save_final=false",
           "report_to=[jsonl]", "logging_steps=1000", *MODES[mode]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    reached = next((s for s, a in evals if a >= args.target), None)
    return reached, (evals[-1][1] if evals else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--eval-steps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    args = ap.parse_args()
    runs: dict = {m: {} for m in args.modes}
    final: dict = {m: {} for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in args.modes:
                steps, acc = run(mode, seed, args, os.path.join(tmp, f"{mode}_{seed}"))
                runs[mode][seed], final[mode][seed] = steps, acc
                print(f"{mode:6s} seed {seed}: eval_accuracy >= {args.target} at step {steps} (last eval {acc})",
                      flush=True)
    # a run that never reached the target counts as max_steps + 1 in the median (so it cannot look faster)
    med = {m: statistics.median([s if s is not None else args.max_steps + 1 for s in runs[m].values()])
           for m in args.modes}
    print(json.dumps({"target": args.target, "max_steps": args.max_steps, "eval_steps": args.eval_steps,
                      "runs": runs, "median": med, "final_eval_accuracy": final}))


if __name__ == "__main__":
    main()

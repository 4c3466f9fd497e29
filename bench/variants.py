"""Per-step cost of the GRPO variants and memory options (issue 19) on the tiny reference model: runs bench/step.py
once per option (a fresh process each, so peak RSS is per option) and prints one row per option plus the JSON.

    python bench/variants.py --steps 6
    python bench/variants.py --steps 6 --only baseline lora_r8    # a subset

Each row: median step wall time and CPU time (rank 0 process CPU; steadier than wall time on a shared box),
the reference (+ old) log-prob pass, the update, and peak RSS. The default step (exact-length 64-token
completions) has no EOS, so mask_truncated_completions would mask everything: its row and its baseline use
--no-exact-length (completions end where the model samples EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OVERLONG = ("rewards=[{function: 'bench_common:digit_reward', weight: 1.0}, "
            "{function: 'grpo_dist.rewards.length:soft_overlong_punishment', weight: 1.0}]")
VARIANTS = {
    "baseline": [],
    "gspo_sequence_ratio": ["--set", "importance_sampling_level=sequence"],
    "dual_clip_c3": ["--set", "dual_clip_c=3"],
    "entropy_coef_0.01": ["--set", "entropy_coef=0.01"],
    "kl_estimator_k1": ["--set", "kl_estimator=k1"],
    "kl_in_reward": ["--set", "kl_in_reward=true"],
    "soft_overlong_reward": ["--set", OVERLONG],
    "dynamic_sampling": ["--set", "dynamic_sampling=true"],
    "lora_r8": ["--set", "lora.r=8"],
    "baseline_free_length": ["--no-exact-length"],
    "mask_truncated_free_length": ["--no-exact-length", "--set", "mask_truncated_completions=true"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    rows = {}
    for name, extra in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, os.path.join(HERE, "step.py"), "--steps", str(args.steps)] + extra
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows[name] = {k: r[k] for k in ("step_time_median_s", "step_cpu_median_s", "logprobs_median_s",
                                        "update_median_s", "load_average")}
        rows[name]["peak_rss_mib"] = r["peak_memory_per_rank"][0]["peak_rss_mib"]
        print(f"{name:28s} wall {r['step_time_median_s']:.3f} s  cpu {r['step_cpu_median_s']:.3f} s  logprobs "
              f"{r['logprobs_median_s']:.3f} s  update {r['update_median_s']:.3f} s  peak RSS "
              f"{rows[name]['peak_rss_mib']:.0f} MiB  (load {r['load_average']})", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

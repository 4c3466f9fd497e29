"""Benchmark a math grader: accuracy on a labelled set, hostile inputs, throughput.

    python bench/grader.py --grader ours                # labelled set + hostile set
    python bench/grader.py --grader math-verify         # needs: pip install 'grpo_dist[math-verify]'
    python bench/public_pairs.py MATH_VERIFY_CHECKOUT/tests /tmp/pairs.jsonl   # the public-suite pairs
    python bench/grader.py --grader ours --throughput   # RewardComputer completions/s
    python bench/grader.py --cases tests/data/math_cases_round2.jsonl --skip-hostile \
        --math-verify-python /tmp/mv-venv/bin/python    # ours and math-verify, per category

Labelled set (JSON lines: completion, reference, label or expected, category):
each item is graded in-process and timed; prints accuracy, false positives
(graded 1, label 0), false negatives, p50/p99/max latency and the misses per
category.  --per-category adds a table of size / accuracy / false positives per
category.  --math-verify-python PY grades the same pairs with math-verify in a
subprocess run by PY (a separate venv that has math-verify installed, so it is
never a dependency of this project) and prints both graders side by side.

Hostile set (JSON lines: name, reference, completion or parts=[[text, count]];
"{MARKER}" is replaced by a path in a fresh temporary directory): each item is
graded in an isolated worker process (grpo_dist's RewardComputer, killed after
--hostile-timeout s), timed from the parent.  Prints how many items took over
1 s, how many got a nonzero reward and whether any marker file was created (i.e.
the grader executed model text).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GRADERS = {"ours": "grader:ours_reward", "math-verify": "grader:math_verify_reward"}


def ours_reward(completion: str, reference: str) -> float:
    from grpo_dist.rewards.math import math_reward
    return math_reward(completion, reference)


def math_verify_reward(completion: str, reference: str) -> float:
    """math-verify 0.9 the way most GRPO trainers call it: grpo_dist.rewards:math_verify_reward (the reference in
    $...$ unless it has delimiters, default extraction of the completion)."""
    from grpo_dist.rewards.mathverify import math_verify_reward as reward
    return reward(completion, reference)


def _function(name: str):
    return {"ours": ours_reward, "math-verify": math_verify_reward}[name]


def load_jsonl(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def hostile_completion(case: dict, marker: str) -> str:
    if "parts" in case:
        text = "".join(s * n for s, n in case["parts"])
    else:
        text = case["completion"]
    return text.replace("{MARKER}", marker)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _label(c: dict) -> int:
    return int(c["label"] if "label" in c else c["expected"])


def grade_all(grader: str, cases: list) -> tuple:
    """(grades, latencies in s, CPU seconds) of one grader on every case, in-process. The CPU time of this thread
    is the steadier figure on a shared machine, where the wall time also counts the other processes' turns."""
    fn = _function(grader)
    fn(cases[0]["completion"], cases[0]["reference"])  # warm-up (imports, caches)
    got, lat, cpu = [], [], []
    for c in cases:
        t, t_cpu = time.perf_counter(), time.thread_time()
        try:
            v = fn(c["completion"], c["reference"])
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - a crash or a timeout (math-verify's alarm) counts as 0.0
            v = 0.0
        lat.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - t_cpu)
        got.append(1 if v == 1.0 else 0)
    return got, lat, cpu


def _category_table(cases: list, columns: dict) -> None:
    cats = sorted({c.get("category", "?") for c in cases})
    head = f"  {'category':<18}{'n':>5}{'pos':>5}" + "".join(f"{name + ' acc':>16}{'FP':>5}" for name in columns)
    print(head)
    rows = cats + ["ALL"]
    for cat in rows:
        idx = [k for k, c in enumerate(cases) if cat == "ALL" or c.get("category", "?") == cat]
        line = f"  {cat:<18}{len(idx):>5}{sum(_label(cases[k]) for k in idx):>5}"
        for got in columns.values():
            ok = sum(got[k] == _label(cases[k]) for k in idx)
            fp = sum(got[k] == 1 and _label(cases[k]) == 0 for k in idx)
            line += f"{100.0 * ok / len(idx):>15.1f}%{fp:>5}"
        print(line)


def _math_verify_subprocess(python: str, path: str) -> tuple:
    import subprocess
    out = tempfile.mktemp(suffix=".json", prefix="mv_grades_")
    cmd = [python, os.path.abspath(__file__), "--grader", "math-verify", "--cases", path,
           "--skip-hostile", "--quiet", "--grades-out", out]
    subprocess.run(cmd, check=True)
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    os.unlink(out)
    return res["grades"], res["latency_s"], res["cpu_s"]


def bench_labelled(grader: str, path: str, per_category: bool = False, mv_python: str | None = None,
                   grades_out: str | None = None, quiet: bool = False) -> dict:
    cases = load_jsonl(path)
    gots, lat, cpu = grade_all(grader, cases)
    if grades_out:
        with open(grades_out, "w", encoding="utf-8") as f:
            json.dump({"grades": gots, "latency_s": lat, "cpu_s": cpu}, f)
    if quiet:
        return {}
    columns = {grader: gots}
    if mv_python:
        mv_got, mv_lat, mv_cpu = _math_verify_subprocess(mv_python, path)
        columns["math-verify"] = mv_got
    figures = {grader: _report(grader, path, cases, gots, lat, cpu)}
    if mv_python:
        figures["math-verify"] = _report("math-verify", path, cases, mv_got, mv_lat, mv_cpu)
    if per_category or mv_python:
        _category_table(cases, columns)
    if mv_python:
        worse = [k for k in range(len(cases)) if gots[k] != _label(cases[k]) and mv_got[k] == _label(cases[k])]
        if worse:
            print(f"  cases math-verify gets right and {grader} does not: {len(worse)}")
            for k in worse:
                c = cases[k]
                print(f"    [{c.get('category', '?')}] ref={c['reference']!r} label={_label(c)} "
                      f"completion={c['completion'][-80:]!r}")
    return figures


def _report(grader: str, path: str, cases: list, gots: list, lat: list, cpu: list) -> dict:
    fp, fn_, miss = 0, 0, Counter()
    for c, got in zip(cases, gots):
        if got != _label(c):
            miss[c.get("category", "?")] += 1
            if got:
                fp += 1
            else:
                fn_ += 1
    n = len(cases)
    print(f"[{grader}] labelled set {os.path.relpath(path, ROOT)}: {n} cases "
          f"({sum(_label(c) for c in cases)} positive)")
    print(f"  accuracy {100.0 * (n - fp - fn_) / n:.1f}%  false positives {fp}  false negatives {fn_}")
    print(f"  latency p50 {1e3 * statistics.median(lat):.2f} ms  p99 {1e3 * pct(lat, 0.99):.2f} ms  "
          f"max {1e3 * max(lat):.2f} ms  (CPU time p50 {1e3 * statistics.median(cpu):.2f} ms  "
          f"p99 {1e3 * pct(cpu, 0.99):.2f} ms; load average {os.getloadavg()[0]:.1f})")
    if miss:
        print("  misses by category: " + ", ".join(f"{k} {v}" for k, v in miss.most_common()))
    return {"cases": n, "accuracy_pct": round(100.0 * (n - fp - fn_) / n, 1), "false_positives": fp,
            "false_negatives": fn_, "p50_ms": round(1e3 * statistics.median(lat), 2),
            "p99_ms": round(1e3 * pct(lat, 0.99), 2), "max_ms": round(1e3 * max(lat), 1),
            "cpu_p50_ms": round(1e3 * statistics.median(cpu), 2), "cpu_p99_ms": round(1e3 * pct(cpu, 0.99), 2)}


def bench_hostile(grader: str, path: str, timeout: float) -> dict:
    from grpo_dist.rewards import RewardComputer
    cases = load_jsonl(path)
    marker_dir = tempfile.mkdtemp(prefix="grader_hostile_")
    slow, rewarded, lat = [], [], []
    with RewardComputer([{"function": GRADERS[grader]}], num_workers=1, timeout_s=timeout) as rc:
        rc(["warm up \\boxed{1}"], ["1"])
        for k, c in enumerate(cases):
            marker = os.path.join(marker_dir, f"marker_{k}")
            comp = hostile_completion(c, marker)
            t = time.perf_counter()
            total, _ = rc([comp], [c["reference"]])
            dt = time.perf_counter() - t
            lat.append(dt)
            if dt >= 1.0:
                slow.append((c["name"], dt))
            if total[0] != 0.0:
                rewarded.append(c["name"])
        stats = rc.stats
    created = sorted(os.listdir(marker_dir))
    print(f"[{grader}] hostile set {os.path.relpath(path, ROOT)}: {len(cases)} cases, limit {timeout:.0f} s per item")
    print(f"  over 1 s: {len(slow)}  nonzero reward: {len(rewarded)}  marker files created: {len(created)}"
          f"  worker kills (timeouts): {stats.get('timeouts', 0)}")
    print(f"  latency p50 {1e3 * statistics.median(lat):.1f} ms  max {1e3 * max(lat):.1f} ms (includes IPC)")
    if slow:
        print("  slow: " + ", ".join(f"{n} {d:.1f}s" for n, d in slow))
    if rewarded:
        print("  rewarded: " + ", ".join(rewarded))
    if created:
        print("  EXECUTED MODEL TEXT: " + ", ".join(created))
    return {"cases": len(cases), "over_1s": len(slow), "nonzero": len(rewarded), "markers": len(created),
            "max_ms": round(1e3 * max(lat), 1)}


def gsm8k_mix(path: str, limit: int) -> tuple:
    refs = [json.loads(line)["answer"].split("####")[-1].strip() for line in open(path, encoding="utf-8")][:limit]
    filler = ("Let's think step by step. First we compute the cost of each item, then multiply by the "
              "number of items and subtract what was already paid. ") * 6
    comps, out_refs = [], []
    for r in refs:
        n = r.replace(",", "")
        variants = [f"{filler}\nSo the answer is $\\boxed{{{r}}}$.",
                    f"{filler}\n#### {n}",
                    f"{filler}\nThe final answer is {int(float(n)) + 1}.",
                    f"{filler}\nThus we get $\\boxed{{\\frac{{{n}}}{{2}}}}$."]
        comps.extend(variants)
        out_refs.extend([r] * len(variants))
    return comps, out_refs


def bench_throughput(grader: str, data: str, workers: int, limit: int) -> None:
    from grpo_dist.rewards import RewardComputer
    comps, refs = gsm8k_mix(data, limit)
    fn = _function(grader)
    t = time.perf_counter()
    for c, r in zip(comps, refs):
        fn(c, r)
    dt_in = time.perf_counter() - t
    with RewardComputer([{"function": GRADERS[grader]}], num_workers=workers, timeout_s=5.0) as rc:
        rc(comps[:8], refs[:8])  # wait for workers to start
        t = time.perf_counter()
        totals, _ = rc(comps, refs)
        dt = time.perf_counter() - t
    print(f"[{grader}] throughput on a GSM8K-like mix ({len(comps)} completions, {sum(totals):.0f} correct):")
    print(f"  in-process, 1 thread: {len(comps) / dt_in:.0f} completions/s")
    print(f"  RewardComputer, {workers} worker processes: {len(comps) / dt:.0f} completions/s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grader", choices=sorted(GRADERS), default="ours")
    ap.add_argument("--cases", default=os.path.join(ROOT, "tests/data/math_cases.jsonl"))
    ap.add_argument("--hostile", default=os.path.join(ROOT, "tests/data/math_hostile.jsonl"))
    ap.add_argument("--hostile-timeout", type=float, default=10.0)
    ap.add_argument("--skip-labelled", action="store_true")
    ap.add_argument("--skip-hostile", action="store_true")
    ap.add_argument("--throughput", action="store_true", help="also measure batch throughput")
    ap.add_argument("--per-category", action="store_true", help="table of accuracy / FP per category")
    ap.add_argument("--math-verify-python", default=None,
                    help="python of a separate venv with math-verify==0.9.0: grade the same pairs with it")
    ap.add_argument("--grades-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gsm8k", default=os.path.join(os.environ.get("GRPO_DIST_DATA_DIR", "data"), "gsm8k/test.jsonl"),
                    help="GSM8K test file (default: from the $GRPO_DIST_DATA_DIR mirror)")
    ap.add_argument("--limit", type=int, default=1319, help="GSM8K references used for throughput")
    args = ap.parse_args(argv)
    figures: dict = {}
    if not args.skip_labelled:
        figures["labelled"] = bench_labelled(args.grader, args.cases, args.per_category, args.math_verify_python,
                                             args.grades_out, args.quiet)
    if not args.skip_hostile:
        figures["hostile"] = bench_hostile(args.grader, args.hostile, args.hostile_timeout)
    if args.throughput:
        bench_throughput(args.grader, args.gsm8k, args.workers, args.limit)
    if not args.quiet:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()

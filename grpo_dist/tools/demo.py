"""The built-in demo: a base model that GRPO can visibly improve, shipped with the package (SHIPPED_BASE, 1.9 MB).

    python -m grpo_dist.tools.demo build-base --out outputs/demo_base        # rebuild it (or reuse a cached build)
    python -m grpo_dist.tools.demo summary --base-eval A.json --final-eval B.json --out OUT/demo_summary.json \\
        --wall-time-s T [--best-eval C.json]

`bash launch/demo.sh OUTPUT_DIR` runs the whole demo (venv, base model, evaluation before and after GRPO, plots).
`bash launch/demo.sh --real OUTPUT_DIR` runs it on the real SmolLM2-135M-Instruct (configs/demo_real_cpu.yaml).
The demos' reward functions, `number_match` and `final_answer_only`, are in grpo_dist.rewards.format.

Why a warm start with noisy answers: GRPO only learns from groups whose completions disagree (some right, some
wrong). A real instruction model on MATH is in exactly that state: it solves a problem some of the time (a public
GRPO-from-scratch recipe: Qwen3-0.6B, 15 % greedy) and GRPO turns "sometimes" into "usually". A random model is
right never (no signal); a model trained on clean answers is right always (nothing to learn). So the base model
is a tiny Qwen2 (character tokenizer, 0.47 M parameters) trained for 400 supervised steps on the built-in addition
task where 60 % of the target answers are one too large: it learns addition together with the habit, so its greedy
answer is right only about 40 % of the time on held-out problems, while one of 8 samples is right about 90 % of the
time. GRPO rewards the exact sum and unlearns the habit (held-out greedy accuracy ~40 % -> ~75 % in 150 steps on 2
CPU processes).

Measured alternatives (2 ranks, the demo config, held-out greedy accuracy): wrong answers spread over +-1..3 give a
base whose greedy errors come from not knowing the sum, and GRPO then *lowered* held-out accuracy (39 % -> 26 % in
100 steps) while raising training reward: it memorised training problems. A consistent offset is one behaviour that
every problem shares, so what GRPO fixes on training problems carries over to held-out ones.

Why shipped rather than built: 400 warm-start steps amplify the last-bit rounding differences of the CPU's matrix
kernels (AVX2 / AVX-512) into different models (40 %, 44 %, 47.5 % held-out greedy accuracy from the same code),
and the demo's gain depends on which one it gets. The shipped weights are the same bytes on every machine, so the
demo starts from the same model everywhere. `build-base` stays for changing the base model (then point
model.name_or_path, or DEMO_BASE for launch/demo.sh, at the new directory).

A built model is cached: its directory holds `demo_base.json` with the settings it was built from; a second
`build-base` with the same settings returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SETTINGS_FILE = "demo_base.json"
# The shipped base model (package data, setup.cfg), made at commit 83eb4c8 with torch 2.13.0+cpu, transformers 5.24.0
# on an AMD EPYC (AVX-512, default kernels, 1 thread) by
#     python -m grpo_dist.tools.demo build-base --out grpo_dist/tools/demo_base --force
# (demo_base.json there records the same in "made_by"). It scores 40 % greedy on the 80 held-out problems, 35 % on
# the training problems. Rebuilding changes it on another CPU kind: replace it only on purpose, re-measure the demo
# (docs/demo.md) and re-record the golden trajectories (python -m tests.golden --record) in the same commit.
SHIPPED_BASE = Path(__file__).resolve().parent / "demo_base"


@dataclass
class BaseSettings:
    """Everything that determines the base model (the cache key)."""
    architecture: str = "qwen2"
    hidden_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_operand: int = 19           # the arithmetic task: a+b with 0 <= a, b <= max_operand
    data_seed: int = 0              # data.arithmetic.seed: which problems are held out
    noise: float = 0.6              # fraction of warm-start targets replaced by a wrong number
    noise_offsets: tuple = (1,)     # how far the wrong number lies from the right one (drawn uniformly)
    sft_steps: int = 400
    sft_batch_size: int = 64
    sft_learning_rate: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def arithmetic_opts(s: BaseSettings) -> dict:
    """The data.arithmetic options of the task the base model was warm-started on (the demo config uses the same)."""
    return {"max_operand": s.max_operand, "num_operands": 2, "ops": "+", "seed": s.data_seed}


def noisy_answer(answer: int, rng: random.Random, s: BaseSettings) -> int:
    """The warm-start target: the right answer, or (with probability s.noise) a nearby wrong non-negative one."""
    if rng.random() >= s.noise:
        return answer
    while True:
        wrong = answer + rng.choice(s.noise_offsets)
        if wrong >= 0 and wrong != answer:
            return wrong


def _encode(tokenizer, prompt: str, target: str):
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p, t


def _sft_batch(tokenizer, examples, rng: random.Random, s: BaseSettings):
    """Right-padded ids, and labels that cover only the answer and its EOS (-100 elsewhere)."""
    rows = []
    for _ in range(s.sft_batch_size):
        e = examples[rng.randrange(len(examples))]
        p, t = _encode(tokenizer, e.prompt, str(noisy_answer(int(e.answer), rng, s)))
        rows.append((p + t, [-100] * len(p) + t))
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r[0]) for r in rows])[:, None]).long()
    return ids, mask, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples, max_new_tokens: int = 4) -> float:
    from grpo_dist.rollout import generate_rollouts
    model.eval()
    batch = generate_rollouts(model, tokenizer, [e.prompt for e in examples], [e.answer for e in examples],
                              num_generations=1, max_completion_length=max_new_tokens, do_sample=False)
    return sum(c.strip() == r for c, r in zip(batch.completions, batch.references)) / max(len(examples), 1)


def build_base(out: str | Path, s: BaseSettings | None = None, force: bool = False, log=print) -> Path:
    """Build the warm-started base model into `out` (an HF model directory), or reuse it when `out` already holds
    one built from the same settings."""
    s = s or BaseSettings()
    out = Path(out)
    meta_path = out / SETTINGS_FILE
    if not force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == s.key() and (out / "config.json").is_file():
            log(f"[demo] base model cached in {out} (built in {meta['build_time_s']:.0f} s; greedy accuracy on "
                f"held-out problems {meta['eval_greedy_accuracy']:.0%})")
            return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: more threads gain little and, on a shared CPU, cost 5-10x
    try:
        return _build(out, s, meta_path, log)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, s: BaseSettings, meta_path: Path, log) -> Path:
    from grpo_dist.config import ModelConfig
    from grpo_dist.data import synthetic_arithmetic
    from grpo_dist.models import build_tiny_model, build_tiny_tokenizer, prepare_tokenizer

    t0 = time.perf_counter()
    mcfg = ModelConfig(tiny=dict(architecture=s.architecture, hidden_size=s.hidden_size,
                                 num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                                 num_key_value_heads=s.num_key_value_heads, intermediate_size=s.intermediate_size,
                                 tokenizer="char", max_position_embeddings=64),
                       init_seed=s.seed)
    tokenizer = prepare_tokenizer(build_tiny_tokenizer(mcfg))
    model = build_tiny_model(mcfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    opts = arithmetic_opts(s)
    train = synthetic_arithmetic(num_examples=10**6, split="train", **opts)
    held_out = synthetic_arithmetic(num_examples=10**6, split="eval", **opts)
    log(f"[demo] building the base model: {s.architecture}, {n_params / 1e6:.2f} M parameters, {s.sft_steps} "
        f"warm-start steps of {s.sft_batch_size} on {len(train)} addition problems, {s.noise:.0%} of the answers "
        f"wrong on purpose")
    rng = random.Random(s.seed)
    torch.manual_seed(s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.sft_learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.0, 1 - i / s.sft_steps))
    bar = _progress(s.sft_steps, "warm start")
    every = max(1, s.sft_steps // 10)  # without a terminal (a log): a line per tenth of the steps instead
    model.train()
    for i in range(1, s.sft_steps + 1):
        ids, mask, labels = _sft_batch(tokenizer, train, rng, s)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        elif i % every == 0 or i == s.sft_steps:
            log(f"[demo] warm start: step {i}/{s.sft_steps}, loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    if bar is not None:
        bar.close()
    acc_train = greedy_accuracy(model, tokenizer, train)
    acc_eval = greedy_accuracy(model, tokenizer, held_out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(out)
    elapsed = time.perf_counter() - t0
    meta_path.write_text(json.dumps({"key": s.key(), "settings": asdict(s), "parameters": n_params,
                                     "build_time_s": elapsed, "train_greedy_accuracy": acc_train,
                                     "eval_greedy_accuracy": acc_eval}, indent=1))
    log(f"[demo] base model written to {out} in {elapsed:.0f} s: greedy accuracy {acc_train:.0%} on training "
        f"problems, {acc_eval:.0%} on held-out problems")
    return out


def write_summary(base_eval: str | Path, final_eval: str | Path, out: str | Path, wall_time_s: float,
                  extra: dict | None = None, title: str = "Held-out addition problems never seen in training",
                  best_eval: str | Path | None = None) -> dict:
    """OUTPUT_DIR/demo_summary.json from the evaluation results (before; after: the last checkpoint, and with
    best_eval the best one, output_dir/best/ of save_best: best_accuracy, best_step), and a table on stdout."""
    base, final = json.loads(Path(base_eval).read_text()), json.loads(Path(final_eval).read_text())
    summary = {"base_accuracy": base["accuracy"], "final_accuracy": final["accuracy"], "wall_time_s": wall_time_s,
               "num_eval_problems": final["num_examples"]}
    for k in sorted({k for k in base if k.startswith("pass@")} & {k for k in final if k.startswith("pass@")},
                    key=lambda k: int(k[5:])):
        summary[f"base_{k}"], summary[f"final_{k}"] = base[k], final[k]
    if "truncated_fraction" in base and "truncated_fraction" in final:
        summary["base_truncated_fraction"] = base["truncated_fraction"]
        summary["final_truncated_fraction"] = final["truncated_fraction"]
    best_line = ""
    if best_eval is not None:
        best = json.loads(Path(best_eval).read_text())
        record = Path(best["model"]) / "best.json"  # which step best/ holds (checkpoint.BEST_FILE)
        summary["best_accuracy"] = best["accuracy"]
        summary["best_step"] = json.loads(record.read_text())["step"] if record.is_file() else None
        if "truncated_fraction" in best:
            summary["best_truncated_fraction"] = best["truncated_fraction"]
        best_line = f"  best checkpoint (step {summary['best_step']}, {best['model']}): greedy accuracy " \
                    f"{best['accuracy']:.1%}; the last: {final['accuracy']:.1%}"
    summary.update(extra or {})
    Path(out).write_text(json.dumps(summary, indent=1) + "\n")
    rows = [("greedy accuracy (pass@1)", "base_accuracy", "final_accuracy")]
    temperature = final.get("temperature", 1.0)
    rows += [(f"{k[5:]} sampled at T={temperature:g}", k, k.replace("base_", "final_")) for k in summary
             if k.startswith("base_pass@")]
    if "base_truncated_fraction" in summary:
        rows.append(("greedy answers cut off", "base_truncated_fraction", "final_truncated_fraction"))
    print(f"\n{title} ({summary['num_eval_problems']}):")
    print(f"  {'':28s} {'before':>8s} {'after':>8s}")
    for label, a, b in rows:
        print(f"  {label:28s} {summary[a]:8.1%} {summary[b]:8.1%}")
    if best_line:
        print(best_line)
    print(f"  wall time {wall_time_s / 60:.1f} min; summary in {out}")
    return summary


def pair_completions(base_file: str | Path, final_file: str | Path, out: str | Path, show: int = 3) -> list[dict]:
    """Join the greedy completions of the two evaluations by problem, write them as JSON lines to `out`, and print
    the first `show` problems (the first ones, not picked by outcome) with how many answers flipped each way."""
    def read(path):
        return {r["index"]: r for r in map(json.loads, Path(path).read_text().splitlines())}
    before, after = read(base_file), read(final_file)
    pairs = [{"problem": b["problem"], "reference": b["reference"], "before": b["completion"],
              "before_correct": b["correct"], "before_truncated": b["truncated"], "after": after[i]["completion"],
              "after_correct": after[i]["correct"], "after_truncated": after[i]["truncated"]}
             for i, b in sorted(before.items()) if i in after]
    Path(out).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    fixed = sum(not p["before_correct"] and p["after_correct"] for p in pairs)
    broken = sum(p["before_correct"] and not p["after_correct"] for p in pairs)
    print(f"\nGreedy completions, first {min(show, len(pairs))} held-out problems (all {len(pairs)} in {out}; "
          f"{fixed} went wrong -> right, {broken} right -> wrong):")
    mark = {True: "right", False: "wrong"}
    for p in pairs[:show]:
        print(f"  {p['problem']}  (answer {p['reference']})")
        for when in ("before", "after"):
            cut = ", cut off" if p[f"{when}_truncated"] else ""
            print(f"    {when:6s} [{mark[p[f'{when}_correct']]}{cut}] {p[when]!r}")
    return pairs


def _progress(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_dist.tools.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-base", help="build (or reuse) the warm-started base model")
    b.add_argument("--out", default="outputs/demo_base")
    b.add_argument("--force", action="store_true", help="rebuild even if a matching model is cached")
    b.add_argument("--noise-offsets", help="comma-separated offsets of the wrong answers (repeat one to weight it)")
    defaults = BaseSettings()
    for name, value in asdict(defaults).items():
        if isinstance(value, tuple):
            continue
        b.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    m = sub.add_parser("summary", help="write demo_summary.json from the before/after evaluation JSON files")
    m.add_argument("--base-eval", required=True)
    m.add_argument("--final-eval", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--wall-time-s", type=float, required=True)
    m.add_argument("--best-eval", help="the evaluation of output_dir/best/ (save_best): best_accuracy, best_step")
    m.add_argument("--title", default="Held-out addition problems never seen in training")
    m.add_argument("--base-completions", help="eval_base_completions.jsonl (python -m grpo_dist.tools.evaluate "
                   "--completions): with --final-completions, print a few completions before and after")
    m.add_argument("--final-completions")
    m.add_argument("--pairs-out", help="where the paired completions go (default: next to --out)")
    m.add_argument("--show", type=int, default=3, help="completions printed before/after")
    args = p.parse_args(argv)
    if args.cmd == "summary":
        write_summary(args.base_eval, args.final_eval, args.out, args.wall_time_s, title=args.title,
                      best_eval=args.best_eval)
        if args.base_completions and args.final_completions:
            pairs_out = args.pairs_out or Path(args.out).with_name("sample_completions.jsonl")
            pair_completions(args.base_completions, args.final_completions, pairs_out, args.show)
        return 0
    if args.cmd == "build-base":
        s = BaseSettings(**{k: getattr(args, k) for k in asdict(defaults) if k != "noise_offsets"})
        if args.noise_offsets:
            s.noise_offsets = tuple(int(x) for x in args.noise_offsets.split(","))
        build_base(args.out, s, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The same GRPO work through TRL's GRPOTrainer and through grpo_dist, alternating runs, and the ratio.

Setup (once): a separate venv so TRL's dependencies never touch the project's:
    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 && \
        .venv-bench/bin/pip install trl==1.16.0 -e .
Run (both systems run under the same interpreter, so the same torch / transformers):
    .venv-bench/bin/python bench/compare_trl.py --world-size 1 --reps 3 --steps 6
    .venv-bench/bin/python bench/compare_trl.py --world-size 2 --reps 3 --steps 6

The model is built once (grpo_dist's tiny Qwen2, or --model PATH) and saved with save_pretrained with its
tokenizer, and both trainers load that directory: same weights, same tokenizer, same prompts (the first prompts of
the built-in arithmetic set, rendered identically), same reward (fraction of digits, in-process).

How the settings map (grpo_dist key = TRL GRPOConfig field):
    prompts_per_rank x num_generations      = per_device_train_batch_size (TRL counts completions: 4 x 8 = 32)
    (one optimizer step per rollout batch)  = gradient_accumulation_steps=1, steps_per_generation=1
    num_generations=8                       = num_generations=8
    max_completion_length=64                = max_completion_length=64
    exact length (min = max new tokens)     = generation_kwargs={"min_new_tokens": 64}
                                              (grpo_dist: min_completion_length)
    beta=0.04                               = beta=0.04 (TRL then builds and runs a reference model, like us)
    loss_type=token_mean                    = loss_type="dapo" (both: masked token sum / tokens of the global batch)
    epsilon=0.2, scale_rewards=group        = epsilon=0.2, scale_rewards="group"
    num_iterations=1                        = num_iterations=1 (old log-probs = detached current in both)
    temperature=1, top_p=1, top_k=0         = temperature=1.0, top_p=1.0, top_k=0
    learning_rate=1e-5, max_grad_norm=1     = learning_rate=1e-5, max_grad_norm=1.0, AdamW
    micro_batch_size=32 (all at once)       = per_device_train_batch_size=32 (one forward/backward)
    fp32, no vLLM                           = use_vllm=False, bf16=False, fp16=False, use_cpu=True
    1 thread per rank                       = torch.set_num_threads(1) in every rank (OMP_NUM_THREADS=1)
    (no logging work)                       = report_to="none", logging_steps=1000, save_strategy="no",
                                              log_completions=False, disable_dropout=True
World size 2: TRL runs DDP (accelerate MULTI_CPU, gloo) under torchrun; grpo_dist runs FSDP FULL_SHARD.
Step time: TRL = wall time from on_step_begin to on_step_end (its step includes generation); grpo_dist =
bench/step.py's train_step time. First step of each run excluded; medians over steps, then over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def build_model_dir(args, out: str) -> None:
    """Tiny Qwen2 + tokenizer (or a copy of --model) saved in HF layout."""
    from bench_common import tiny_override
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, [tiny_override(args.tiny_hidden, args.tiny_layers, args.tiny_vocab)])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def prompts(n: int, model_dir: str) -> list[str]:
    from grpo_dist.config import load_config
    from grpo_dist.data import load_examples, render_prompt
    from grpo_dist.models import load_tokenizer
    cfg = load_config(None, [f"model.name_or_path={model_dir}"])
    tok = load_tokenizer(cfg.model)
    ex = load_examples(cfg.data, "train")
    return [render_prompt(e, cfg.data, tok).text for e in ex[:n]]


# ------------------------------------------------------------------------------------------------ the TRL worker
def trl_worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench_common import digit_reward_trl, peak_rss_mib

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    completions = args.prompts_per_rank * args.num_generations
    data = Dataset.from_list([{"prompt": p} for p in prompts(args.prompts_per_rank * world * (args.steps + 1),
                                                                  args.model_dir)])
    tok = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    out = tempfile.mkdtemp(prefix="bench_trl_")
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=completions, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        generation_kwargs={"min_new_tokens": args.max_completion_length} if args.exact_length else None,
        beta=args.beta, loss_type="dapo", epsilon=0.2, scale_rewards="group", num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5, max_grad_norm=1.0,
        use_vllm=False, bf16=False, fp16=False, use_cpu=True, max_steps=args.steps, report_to="none",
        logging_steps=1000, save_strategy="no", log_completions=False, disable_dropout=True, seed=42,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=digit_reward_trl, args=config, train_dataset=data,
                          processing_class=tok)
    gen_times = []
    inner = trainer.model.generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        r = inner(*a, **k)
        gen_times.append(time.perf_counter() - t0)
        return r
    trainer.model.generate = timed_generate
    steps = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            steps.append((time.perf_counter() - self.t0, time.process_time() - self.c0))
    trainer.add_callback(Timer())
    trainer.train()
    timed = steps[1:] if len(steps) > 1 else steps
    gens = gen_times[1:] if len(gen_times) > 1 else gen_times
    step_s = statistics.median(s for s, _ in timed)
    mem = [None] * world
    if world > 1:
        import torch.distributed as dist
        dist.all_gather_object(mem, peak_rss_mib())
    else:
        mem = [peak_rss_mib()]
    if rank == 0:
        tokens = completions * world * args.max_completion_length if args.exact_length else float("nan")
        print(json.dumps(dict(system="trl", world_size=world, step_time_median_s=round(step_s, 4),
                              step_cpu_median_s=round(statistics.median(c for _, c in timed), 4),
                              generate_median_s=round(statistics.median(gens), 4) if gens else None,
                              completion_tokens_per_s=round(tokens / step_s, 1),
                              peak_rss_mib_per_rank=[round(m, 1) for m in mem],
                              step_times=[round(s, 3) for s, _ in steps])), flush=True)


# ---------------------------------------------------------------------------------------------------- the driver
def launch(world: int, script_args: list[str], env) -> dict:
    if world == 1:
        cmd = [sys.executable] + script_args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(29500 + os.getpid() % 1000)] + script_args
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 and results:
        # the run measured and printed its result, then died while exiting (seen with both trainers under gloo:
        # "terminate called without an active exception" after the last collective); keep the measurement
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"warning: exit code {p.returncode} after the result was printed ({last[:160]})", flush=True)
    elif p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return json.loads(results[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="runs of each system, alternating")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", help="HF causal LM directory (default: build the tiny Qwen2)")
    ap.add_argument("--tiny-hidden", type=int, default=128)
    ap.add_argument("--tiny-layers", type=int, default=4)
    ap.add_argument("--tiny-vocab", type=int, default=1024)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompts-per-rank", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--exact-length", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["trl", "grpo_dist"], help="run one system only")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(args)

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    work = tempfile.mkdtemp(prefix="bench_compare_")
    model_dir = args.model or os.path.join(work, "model")
    if not args.model:
        build_model_dir(args, model_dir)
    common = ["--num-generations", str(args.num_generations), "--prompts-per-rank", str(args.prompts_per_rank),
              "--max-completion-length", str(args.max_completion_length), "--beta", str(args.beta),
              "--steps", str(args.steps), "--threads", str(args.threads),
              "--exact-length" if args.exact_length else "--no-exact-length"]
    runs = {"trl": [], "grpo_dist": []}
    systems = [args.only] if args.only else ["trl", "grpo_dist"]
    for rep in range(args.reps):
        for system in (systems if rep % 2 == 0 else systems[::-1]):  # alternate the order too
            if system == "trl":
                r = launch(args.world_size, [__file__, "--trl-worker", "--model-dir", model_dir] + common, env)
            else:
                r = launch(args.world_size, [os.path.join(HERE, "step.py"), "--model", model_dir] + common, env)
            r["load_average"] = round(os.getloadavg()[0], 2)
            runs[system].append(r)
            print(f"rep {rep} {system:9}: step {r['step_time_median_s']:.3f} s, cpu {r['step_cpu_median_s']:.3f} s, "
                  f"load {r['load_average']}", flush=True)
    summary = dict(world_size=args.world_size, reps=args.reps, steps=args.steps)
    for system in systems:
        summary[system] = dict(
            step_time_median_s=round(statistics.median(r["step_time_median_s"] for r in runs[system]), 4),
            step_cpu_median_s=round(statistics.median(r["step_cpu_median_s"] for r in runs[system]), 4),
            completion_tokens_per_s=round(statistics.median(r["completion_tokens_per_s"] for r in runs[system]), 1),
            runs=runs[system])
    if len(systems) == 2:
        summary["ratio_step_time"] = round(summary["grpo_dist"]["step_time_median_s"]
                                           / summary["trl"]["step_time_median_s"], 3)
        summary["ratio_step_cpu"] = round(summary["grpo_dist"]["step_cpu_median_s"]
                                          / summary["trl"]["step_cpu_median_s"], 3)
        print(f"world {args.world_size}: TRL {summary['trl']['step_time_median_s']:.3f} s/step "
              f"(cpu {summary['trl']['step_cpu_median_s']:.3f}), grpo_dist "
              f"{summary['grpo_dist']['step_time_median_s']:.3f} s/step (cpu "
              f"{summary['grpo_dist']['step_cpu_median_s']:.3f}); ratio {summary['ratio_step_time']} wall, "
              f"{summary['ratio_step_cpu']} cpu")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

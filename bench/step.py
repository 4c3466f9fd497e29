"""GRPO step time of grpo_dist, with its split, tokens/s and peak memory per rank.

    python bench/step.py --steps 6                                   # 1 rank
    torchrun --nproc_per_node 2 bench/step.py --steps 6              # 2 ranks
    python bench/step.py --model /path/to/hf_model --max-completion-length 128
    torchrun --nproc_per_node 2 bench/step.py --backend fsdp2        # FSDP2 (fully_shard) instead of FSDP1

Defaults are the issue's reference work: tiny Qwen2 (hidden 128, 4 layers, BPE vocab 1024), num_generations 8,
4 prompts per rank, 64 new tokens (--exact-length forces exactly that many: EOS is banned until then), beta 0.04,
one thread per rank, one micro-batch holding all of a rank's completions (like TRL's per_device_train_batch_size).
The reward is the fraction of digits in a completion (cheap, never constant), graded in-process.

Split (medians over steps, first step excluded): sync = copy of the FSDP shards into the generation replica,
rollout = sampling, reward, logprobs = reference (+ old when num_iterations > 1) forward, update = policy forward +
backward + optimizer step. completion_tokens_per_s = completion tokens of all ranks per step / median step time.
cpu_s = rank 0's process CPU time per step (with one thread, close to wall time on an idle machine; less sensitive
to other jobs on a shared box). Levers can be switched off to measure what each gives: --hf-generate,
--no-lean-decoder, --fsdp-one-rank, --naive-logprobs, --keep-logits (no in-place gradient). --profile prints
torch.profiler's top operators of the last step.
The last output line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import median, peak_rss_mib, tiny_override  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF causal LM directory (default: the tiny random Qwen2)")
    ap.add_argument("--tiny-hidden", type=int, default=128)
    ap.add_argument("--tiny-layers", type=int, default=4)
    ap.add_argument("--tiny-vocab", type=int, default=1024)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompts-per-rank", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--exact-length", action=argparse.BooleanOptionalAction, default=True,
                    help="every completion has exactly max-completion-length tokens (fair comparisons)")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--backend", default="fsdp", choices=["fsdp", "fsdp2", "deepspeed"],
                    help="distributed.backend (fsdp on one full-precision rank: the local engine)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="0: all completions of a rank at once")
    ap.add_argument("--reward", default="digits", choices=["digits", "math"])
    ap.add_argument("--hf-generate", action="store_true", help="lever off: sample with HF generate")
    ap.add_argument("--no-lean-decoder", action="store_true",
                    help="lever off: the lean sampling loop on the model's own forward instead of grpo_dist.decoder")
    ap.add_argument("--fsdp-one-rank", action="store_true",
                    help="lever off: wrap in FSDP also on one full-precision rank (instead of engines/local.py)")
    ap.add_argument("--naive-logprobs", action="store_true", help="lever off: full fp32 log_softmax")
    ap.add_argument("--keep-logits", action="store_true", help="lever off: gradient in a new tensor")
    ap.add_argument("--set", nargs="*", default=[], help="extra grpo_dist config overrides key=value")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's top operators (self CPU time) of the last step on rank 0")
    return ap.parse_args(argv)


def apply_levers(args):
    """Monkeypatches that switch levers off (measurement only) or force the exact length."""
    import torch

    import grpo_dist.trainer as tr
    if args.fsdp_one_rank:
        from grpo_dist.engines.fsdp import FSDPEngine
        tr.build_engine = FSDPEngine
    if args.naive_logprobs:
        def naive(logits, labels, chunk_size=1024, temperature=1.0, overwrite_logits=False, entropy_out=None):
            logp = torch.log_softmax(logits.float() / temperature, -1)
            if entropy_out is not None:
                entropy_out.copy_(-(logp.exp() * logp).sum(-1).detach())
            return logp.gather(-1, labels[..., None]).squeeze(-1)
        tr.selective_log_probs = naive
    elif args.keep_logits:
        sel = tr.selective_log_probs
        tr.selective_log_probs = lambda *a, overwrite_logits=False, **k: sel(*a, **k)


def apply_rollout_levers(args, trainer):
    """Exact completion length (min = max tokens) for every rollout engine; --hf-generate: transformers' generate
    on the replica instead of the rollout engine."""
    from grpo_dist import graded
    spec = graded.sampling_spec
    if args.exact_length:  # what every round samples with (graded.sample_and_grade reads it from its module)
        def exact(*a, **k):
            s = spec(*a, **k)
            s.min_tokens = s.max_tokens
            return s
        graded.sampling_spec = exact
    if args.hf_generate:
        from grpo_dist.data import render_prompt
        from grpo_dist.rollout import generate_rollouts
        cfg = trainer.cfg

        def rollout(examples, timer=None):  # the source synced the replica before the step's first round
            prompts = [render_prompt(e, cfg.data, trainer.tokenizer) for e in examples]
            batch = generate_rollouts(
                trainer.gen_model, trainer.tokenizer, prompts, [e.answer for e in examples],
                num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                max_prompt_length=cfg.data.max_prompt_length, generation_batch_size=cfg.generation_batch_size,
                use_hf_generate=True,
                min_completion_length=cfg.max_completion_length if args.exact_length else 0)
            return graded.grade(cfg, trainer.rewards, examples, batch)
        trainer.source.rollout = rollout


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    from grpo_dist.trainer import GRPOTrainer

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions = args.prompts_per_rank * args.num_generations
    out_dir = tempfile.mkdtemp(prefix="bench_step_")
    overrides = [
        f"num_generations={args.num_generations}", f"prompts_per_rank={args.prompts_per_rank}",
        f"max_completion_length={args.max_completion_length}", f"beta={args.beta}", f"max_steps={args.steps}",
        f"micro_batch_size={args.micro_batch_size or completions}", "reward_workers=0", "report_to=[]",
        "progress_bar=false", "save_final=false", "save_steps=0", f"output_dir={out_dir}", "learning_rate=1e-5",
        f"distributed.num_threads={args.threads}", f"distributed.backend={args.backend}",
        "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]" if args.reward == "digits" else
        "rewards=[{function: 'grpo_dist.rewards:math_reward', weight: 1.0}]"]
    overrides.append(f"model.name_or_path={args.model}" if args.model else
                     tiny_override(args.tiny_hidden, args.tiny_layers, args.tiny_vocab))
    if args.no_lean_decoder:
        overrides.append("rollout_engine=hf")
    cfg = load_config(None, overrides + list(args.set))
    apply_levers(args)

    ctx = gdist.init_distributed(cfg.distributed.timeout_s, args.threads)
    t_build = time.perf_counter()
    trainer = GRPOTrainer(cfg, ctx)
    build_s = time.perf_counter() - t_build
    apply_rollout_levers(args, trainer)

    rows = []
    for step in range(args.steps):
        gdist.barrier()
        c0 = time.process_time()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if args.profile and step == args.steps - 1:
            with torch.profiler.profile() as prof:
                m = trainer.train_step()
            if ctx.is_main:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        else:
            m = trainer.train_step()
        cpu = time.process_time() - c0
        sync = m["time_weight_sync_s"]
        tokens = m["completion_length_mean"] * completions * world
        rows.append(dict(step=step, step_s=m["step_time_s"], sync_s=sync, rollout_s=m["time_rollout_s"] - sync,
                         reward_s=m["time_reward_s"], logprobs_s=m.get("time_logprobs_s", 0.0),
                         update_s=m["time_update_s"], cpu_s=cpu, tokens=tokens, reward=m["reward_mean"],
                         loss=m["loss"]))
        if ctx.is_main:
            r = rows[-1]
            print(f"step {step}: {r['step_s']:.3f} s (sync {r['sync_s']:.3f}, rollout {r['rollout_s']:.3f}, reward "
                  f"{r['reward_s']:.3f}, logprobs {r['logprobs_s']:.3f}, update {r['update_s']:.3f}; cpu "
                  f"{r['cpu_s']:.3f}) tokens {tokens:.0f} reward {r['reward']:.3f}", flush=True)

    mem = dict(peak_rss_mib=round(peak_rss_mib(), 1))
    if ctx.device.type == "cuda":
        mem["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    per_rank = [mem]
    if dist.is_initialized() and world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mem)
    timed = rows[1:] if len(rows) > 1 else rows
    med = {k: median([r[k] for r in timed]) for k in
           ("step_s", "sync_s", "rollout_s", "reward_s", "logprobs_s", "update_s", "cpu_s", "tokens")}
    if ctx.is_main:
        result = dict(
            world_size=world, backend=args.backend, engine=type(trainer.engine).__name__, steps=args.steps,
            timed_steps=len(timed),
            step_time_median_s=round(med["step_s"], 4),
            step_cpu_median_s=round(med["cpu_s"], 4),
            sync_median_s=round(med["sync_s"], 4), rollout_median_s=round(med["rollout_s"], 4),
            reward_median_s=round(med["reward_s"], 4), logprobs_median_s=round(med["logprobs_s"], 4),
            update_median_s=round(med["update_s"], 4),
            completion_tokens_per_step=med["tokens"],
            completion_tokens_per_s=round(med["tokens"] / med["step_s"], 1),
            generation_tokens_per_s_per_rank=round(med["tokens"] / world / max(med["rollout_s"], 1e-9), 1),
            peak_memory_per_rank=per_rank, build_s=round(build_s, 2), threads=args.threads,
            load_average=round(os.getloadavg()[0], 2),
            model=args.model or f"tiny qwen2 h{args.tiny_hidden} l{args.tiny_layers} v{args.tiny_vocab}",
            num_generations=args.num_generations, prompts_per_rank=args.prompts_per_rank,
            max_completion_length=args.max_completion_length, exact_length=args.exact_length, beta=args.beta,
            levers_off=[k for k in ("hf_generate", "no_lean_decoder", "fsdp_one_rank", "naive_logprobs",
                                    "keep_logits") if getattr(args, k)])
        print(json.dumps(result), flush=True)
    # Release the FSDP modules before their process group is destroyed: 2-rank runs whose FSDP objects were
    # collected at interpreter exit, after destroy_process_group, aborted in ~1 of 5 runs ("terminate called
    # without an active exception" in a C++ thread); 0 of 22 with this release. (grpo_dist.train freezes the heap
    # at exit instead, so nothing is collected after the group is gone.)
    del trainer
    gc.collect()
    gdist.cleanup()


if __name__ == "__main__":
    main()

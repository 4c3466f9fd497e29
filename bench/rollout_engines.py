"""Rollout engines side by side on a real model: completion tokens/s of lean / hf / vllm, the weight-sync time per
step, and the sampler/trainer log-prob mismatch the trainer logs.

    python bench/rollout_engines.py --engine lean                      # 1 rank (SmolLM2-135M-Instruct, fp32)
    torchrun --nproc_per_node 2 bench/rollout_engines.py --engine vllm # 2 ranks, one engine each
    python bench/rollout_engines.py --engine vllm --model DIR --mixed-precision bf16 --prompts 8 --new-tokens 256

Each rank builds the trainer with rollout_engine=ENGINE, runs one unmeasured rollout (warm-up), then --reps times:
the weight sync (Engine.iter_full_weights into the engine) and one rollout of prompts x G completions of exactly
--new-tokens tokens (min length = max length, so every engine generates the same number of tokens). tokens/s per
rank = tokens / rollout wall time; aggregate = all ranks' tokens / the slowest rank's time. Then --steps real
training steps log sampler_logprob_diff and sampler_kl. Medians; last line: JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # reward_fns


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("lean", "hf", "vllm"), required=True)
    ap.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct, grpo_dist.tools.smollm2)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rank")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="training steps for the logged mismatch (0: none)")
    ap.add_argument("--mixed-precision", default=None, help="bf16: FSDP compute dtype (and vLLM's dtype)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    args = ap.parse_args()

    from grpo_dist.tools import smollm2
    from grpo_dist.config import load_config
    from grpo_dist.distributed import all_reduce_max, all_reduce_sum, cleanup, init_distributed
    from grpo_dist.rollout_engines import prompt_token_ids
    from grpo_dist.data import render_prompt
    from grpo_dist.trainer import GRPOTrainer

    model = str(args.model or smollm2.build_model_dir())
    overrides = [f"model.name_or_path={model}", f"rollout_engine={args.engine}", "output_dir=/tmp/bench_rollout",
                 "reward_workers=0", "progress_bar=false", "report_to=[]", "beta=0", "save_final=false",
                 f"prompts_per_rank={args.prompts}", f"num_generations={args.num_generations}",
                 f"max_completion_length={args.new_tokens}", "learning_rate=1e-5", "data.limit=64",
                 "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]", f"max_steps={max(args.steps, 1)}",
                 f"vllm.kv_cache_gb={args.kv_cache_gb}", "micro_batch_size=8"]
    if args.mixed_precision:
        overrides.append(f"distributed.mixed_precision={args.mixed_precision}")
    cfg = load_config(None, overrides)
    ctx = init_distributed(1800, cfg.distributed.num_threads)
    t0 = time.perf_counter()
    tr = GRPOTrainer(cfg, ctx)
    setup_s = time.perf_counter() - t0
    try:
        examples = tr.sampler.next_batch()
        ids = prompt_token_ids(tr.tokenizer, [render_prompt(e, cfg.data, tr.tokenizer) for e in examples],
                               cfg.data.max_prompt_length)
        spec = tr.sampling_spec()
        spec.min_tokens = args.new_tokens
        tr.sync_rollout_weights()
        tr.rollout_engine.generate(ids, spec)  # warm-up
        sync, gen, toks = [], [], []
        for _ in range(args.reps):
            tr.sync_rollout_weights()
            sync.append(tr.source.weight_sync_s)
            t = time.perf_counter()
            out = tr.rollout_engine.generate(ids, spec)
            gen.append(time.perf_counter() - t)
            toks.append(sum(len(c) for c in out.completion_ids))
        steps = [tr.train_step() for _ in range(args.steps)]
        slowest = [float(x) for x in all_reduce_max(gen, ctx.device)]
        total = [float(x) for x in all_reduce_sum(toks, ctx.device)]
        result = dict(
            engine=args.engine, ranks=ctx.world_size, model=os.path.basename(model.rstrip("/")),
            dtype=args.mixed_precision or "fp32", threads_per_rank=__import__("torch").get_num_threads(),
            rows_per_rank=len(ids) * args.num_generations, new_tokens=args.new_tokens, setup_s=round(setup_s, 1),
            tokens_per_s_rank0=round(statistics.median(t / g for t, g in zip(toks, gen)), 1),
            tokens_per_s_all_ranks=round(statistics.median(t / g for t, g in zip(total, slowest)), 1),
            weight_sync_s=round(statistics.median(sync), 3),
            sampler_logprob_diff=[m["sampler_logprob_diff"] for m in steps],
            sampler_kl=[m["sampler_kl"] for m in steps])
        if ctx.is_main:
            print(json.dumps(result), flush=True)
    finally:
        tr.close()
        cleanup()


if __name__ == "__main__":
    main()

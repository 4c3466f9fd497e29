"""The GPU table of the performance issue: a random-init Qwen2 ~0.5B (hidden 896, 24 layers, vocab 151,936) in bf16
on one GPU - rollout tokens/s, train-step tokens/s and MFU, peak memory; sdpa vs eager attention; activation
checkpointing on/off.

    python bench/gpu_table.py                  # on a CUDA machine, ~3-5 minutes on one H100/H200
    python bench/gpu_table.py --tiny --device cpu --new-tokens 8 --train-rows 4   # smoke run of the script itself

Rollout: 64 rows (8 prompts x G=8) of a 128-token prompt, exactly --new-tokens new tokens (EOS banned), through
grpo_dist's sampling loop on (a) grpo_dist.decoder.LeanDecoder and (b) the model's own transformers forward with
the given attention implementation. Train step: --train-rows sequences of prompt + completion tokens, completion
logits only, chunked selective log-probs, a policy-gradient loss, backward and an AdamW step (the update pass of a
GRPO step). MFU = (6 N + 12 layers x hidden x seq) FLOPs per token / time / --peak-tflops (H100/H200 dense bf16:
989). Peak memory = torch.cuda.max_memory_allocated per measurement. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-64 model (smoke test of the script)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--train-rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attn", default="sdpa,eager")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_dist.decoder import LeanDecoder, prepare_replica
    from grpo_dist.logprobs import selective_log_probs
    from grpo_dist.rollout import HFDecoder, RolloutBatch, _sample_loop, completion_logits

    dev = torch.device(args.device)
    dtype = torch.bfloat16
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024) if args.tiny else \
        dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak():
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib():
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None

    def build(attn):
        config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                             attn_implementation=attn)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).to(dev)

    B = args.prompts * args.num_generations
    P, C = args.prompt_length, args.new_tokens
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, shape["vocab_size"], (args.prompts, P), generator=g).to(dev)
    prompt_mask = torch.ones_like(prompt_ids)
    repeats = torch.full((args.prompts,), args.num_generations, device=dev)
    eos = torch.tensor([0], device=dev)

    def rollout_tokens_per_s(decoder_factory):
        times = []
        for _ in range(args.reps + 1):
            sync()
            t0 = time.perf_counter()
            out = _sample_loop(decoder_factory(), prompt_ids, prompt_mask, repeats, max_new_tokens=C, temperature=1.0,
                               top_p=1.0, top_k=0, min_new_tokens=C, do_sample=True, eos_ids=eos, pad=1)
            sync()
            times.append(time.perf_counter() - t0)
        assert out.shape == (B, C)
        return B * C / statistics.median(times[1:])

    rows = []
    for attn in args.attn.split(","):
        model = build(attn).eval().requires_grad_(False)
        n_params = sum(p.numel() for p in model.parameters())
        reset_peak()
        hf_tps = rollout_tokens_per_s(lambda m=model: HFDecoder(m))
        hf_peak = peak_gib()
        prepare_replica(model)
        reset_peak()
        lean_tps = rollout_tokens_per_s(lambda m=model: LeanDecoder(m))
        lean_peak = peak_gib()
        for ac in (False, True):
            model.train().requires_grad_(True)
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            n = args.train_rows
            ids = torch.randint(10, shape["vocab_size"], (n, P + C), generator=g).to(dev)
            batch = RolloutBatch(ids[:, :P], torch.ones(n, P, dtype=torch.long, device=dev), ids[:, P:],
                                 torch.ones(n, C, dtype=torch.long, device=dev), args.num_generations)
            adv = torch.randn(n, 1, device=dev)
            reset_peak()
            times = []
            for _ in range(args.reps + 1):
                sync()
                t0 = time.perf_counter()
                logits = completion_logits(model, batch)
                logp = selective_log_probs(logits, batch.completion_ids, overwrite_logits=True)
                loss = -(logp * adv).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del logits, logp, loss
                sync()
                times.append(time.perf_counter() - t0)
            step_s = statistics.median(times[1:])
            tokens = n * (P + C)
            flops_per_token = 6 * n_params + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * (P + C)
            rows.append(dict(attn=attn, activation_checkpointing=ac, params_m=round(n_params / 1e6, 1),
                             rollout_tokens_per_s_lean=round(lean_tps), rollout_peak_gib_lean=lean_peak,
                             rollout_tokens_per_s_hf_forward=round(hf_tps), rollout_peak_gib_hf_forward=hf_peak,
                             train_step_s=round(step_s, 4), train_tokens_per_s=round(tokens / step_s),
                             mfu=round(flops_per_token * tokens / step_s / (args.peak_tflops * 1e12), 4),
                             train_peak_gib=peak_gib()))
            del opt
        del model
        reset_peak()

    header = ["attn", "AC", "rollout tok/s lean", "rollout tok/s hf fwd", "rollout peak GiB lean/hf",
              "train tok/s", "train step s", "MFU", "train peak GiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['attn']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['rollout_tokens_per_s_lean']} "
              f"| {r['rollout_tokens_per_s_hf_forward']} | {r['rollout_peak_gib_lean']} / "
              f"{r['rollout_peak_gib_hf_forward']} | {r['train_tokens_per_s']} | {r['train_step_s']} | "
              f"{r['mfu']:.1%} | {r['train_peak_gib']} |")
    print(json.dumps(dict(device=str(dev), gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None,
                          rows_per_rollout=B, prompt_length=P, new_tokens=C, train_rows=args.train_rows,
                          results=rows)))


if __name__ == "__main__":
    main()

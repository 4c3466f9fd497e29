"""Peak memory per rank, LoRA (lora.r > 0) vs full fine-tuning, with beta > 0 (a reference model is needed).

    python bench/lora_memory.py --model ~/.cache/grpo_dist/SmolLM2-135M-Instruct --world 2
    python bench/lora_memory.py --world 1                    # the tiny model (no --model)

Each setting runs in fresh torchrun processes: build the trainer, two GRPO steps (2 prompts x 4 completions of 16
tokens per rank). Per rank it reports
  build_peak_rise_mib       VmHWM rise while building the trainer, over the RSS before (imports, tokenizer and
                            data already loaded): loading the weights, wrapping, the generation replica
  rss_after_build_rise_mib  what building left resident
  steps_peak_rise_mib       VmHWM rise during two GRPO steps over the RSS after building (host RAM on CPU);
                            with CUDA also peak_gpu_mib (max allocated over the whole run)
  params/grads/optimizer/reference_mib   bytes of this rank's tensors: policy parameters (shards under FSDP),
                     gradients (kept by running a third step's backward without its optimizer step), AdamW state,
                     and the reference model (LoRA: none; it is the policy with its adapters off)
The generation replica (a full unsharded copy of the model per rank) is in the peak of both settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import print_rank_results, run_worker  # noqa: E402
from bench_common import status_mib as _status_mib  # noqa: E402


def worker(args):
    import torch

    from bench_common import tiny_override
    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    from grpo_dist.data import load_examples
    from grpo_dist.models import load_tokenizer
    from grpo_dist.trainer import GRPOTrainer
    torch.set_num_threads(1)
    ctx = gdist.init_distributed(600, 1)
    model = f"model.name_or_path={args.model}" if args.model else tiny_override()
    cfg = load_config(None, [model, f"beta={args.beta}", f"lora.r={args.lora_r}", "reward_workers=0",
                             "report_to=[]", "progress_bar=false", "save_final=false", "num_generations=4",
                             "prompts_per_rank=2", "max_completion_length=16", "micro_batch_size=8",
                             "learning_rate=1e-5", f"output_dir={tempfile.mkdtemp(prefix='bench_lora_')}",
                             "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]"])
    load_tokenizer(cfg.model), load_examples(cfg.data, "train")
    gdist.barrier()
    base = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    trainer = GRPOTrainer(cfg, ctx)
    built_rise = _status_mib("VmHWM") - base
    before_steps = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(2):
        trainer.train_step()
    steps_rise = _status_mib("VmHWM") - before_steps
    eng = trainer.engine
    step = eng.step
    eng.step = lambda skip=False: None  # a third backward without its optimizer step keeps the gradients
    try:
        trainer.train_step()
    except Exception:  # noqa: BLE001 - the skipped step's metrics do not matter; the gradients do
        pass
    eng.step = step
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
    params = list(eng.module.parameters())
    ref = trainer.ref_model
    out = dict(build_peak_rise_mib=round(built_rise, 1), rss_after_build_rise_mib=round(before_steps - base, 1),
               steps_peak_rise_mib=round(steps_rise, 1),
               params_mib=round(nbytes(params), 1),
               trainable_params=sum(p.numel() for p in params if p.requires_grad),
               grads_mib=round(nbytes([p.grad for p in params if p.grad is not None]), 1),
               optimizer_mib=round(nbytes([v for s in eng.optimizer.state.values() for v in s.values()
                                           if torch.is_tensor(v)]), 1),
               reference_mib=round(nbytes(list(ref.parameters())) if ref is not None else 0.0, 1))
    if ctx.device.type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print_rank_results(out, ctx)
    del trainer, eng
    gdist.cleanup()


def run(args, lora_r):
    return run_worker(__file__, args.world, ["--lora-r", str(lora_r), "--beta", str(args.beta)]
                      + (["--model", args.model] if args.model else []), 29300 + os.getpid() % 300 + lora_r)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the tiny random Qwen2)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lora-r", type=int, default=16, help="rank of the LoRA setting")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    result = {}
    for name, r in (("full", 0), (f"lora_r{args.lora_r}", args.lora_r)):
        result[name] = run(args, r)
        for rank, m in enumerate(result[name]):
            print(f"{name:10s} rank {rank}: peak rise building {m['build_peak_rise_mib']:.0f} MiB, held after "
                  f"building {m['rss_after_build_rise_mib']:.0f} MiB, peak rise in 2 steps "
                  f"{m['steps_peak_rise_mib']:.0f} MiB; params {m['params_mib']:.0f}, "
                  f"grads {m['grads_mib']:.1f}, optimizer {m['optimizer_mib']:.1f}, reference "
                  f"{m['reference_mib']:.0f} MiB; trainable {m['trainable_params']}", flush=True)
    print(json.dumps(dict(model=args.model or "tiny", world=args.world, beta=args.beta, ranks=result)))


if __name__ == "__main__":
    main()

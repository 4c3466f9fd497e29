"""Memory per rank: (1) params + grads + optimizer state at 1 vs 2 ranks; (2) host RAM while loading a pretrained
model on one node, rank 0 reading the weights (others on the meta device) vs every rank reading them.

    python bench/memory.py                 # both parts, launching torchrun itself; ~20M-param model for part 2
    python bench/memory.py --part states --hidden 256 --layers 4 --vocab 32000
    python bench/memory.py --backend fsdp2     # FSDP2 (fully_shard): local DTensor shards are counted

(1) counts the local shards of the FSDP policy after one real GRPO step: parameters, gradients (kept by running
    the backward of a second step without its optimizer step) and AdamW state (exp_avg, exp_avg_sq, step).
(2) saves the model once with save_pretrained, then starts 2 ranks that build GRPOTrainer from it (policy,
    reference, generation replica) and reports each rank's peak RSS rise over its RSS before building (VmHWM),
    first after construction, then after one step (when the replica of a meta-built rank gets its values).
    "all ranks read" switches the rank-0 path off (every rank calls from_pretrained), as before the lever.
    The safetensors file is memory-mapped: its pages are shared page cache but count in each reader's RSS.
On CUDA (not measured here): rank 0 reads into host RAM, the other ranks build on the meta device, and FSDP
materialises each unit on the GPU and broadcasts rank 0's values (sync_module_states=True), so host RAM holds one
copy per node and every GPU only its shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_common import print_rank_results, run_worker  # noqa: E402
from bench_common import status_mib as _status_mib  # noqa: E402


def _cfg(model_dir, extra=()):
    from grpo_dist.config import load_config
    return load_config(None, [f"model.name_or_path={model_dir}", "beta=0.04", "reward_workers=0", "report_to=[]",
                              "progress_bar=false", "save_final=false", "num_generations=4", "prompts_per_rank=2",
                              "max_completion_length=8", "micro_batch_size=8", "learning_rate=1e-5",
                              f"output_dir={tempfile.mkdtemp(prefix='bench_mem_')}",
                              "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]", *extra])


def worker(args):
    import torch

    from grpo_dist import distributed as gdist
    torch.set_num_threads(1)
    ctx = gdist.init_distributed(600, 1)
    import grpo_dist.build as build
    import grpo_dist.engines.fsdp as ef
    import grpo_dist.engines.fsdp2 as ef2
    import grpo_dist.trainer as tr
    if args.all_ranks_read:  # where the models are built (build.py) and wrapped (the engines)
        build.load_on_rank0_only = ef.load_on_rank0_only = ef2.load_on_rank0_only = lambda cfg, world: False
    cfg = _cfg(args.model_dir, [f"distributed.backend={args.backend}"])
    out = {}
    if args.part == "load":
        # import and read everything but the weights first, so the rise is the models alone
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401
        from accelerate import init_empty_weights  # noqa: F401
        from torch.distributed.checkpoint import state_dict  # noqa: F401
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401

        from grpo_dist.data import load_examples
        from grpo_dist.models import load_tokenizer
        from grpo_dist.rewards import RewardComputer  # noqa: F401
        load_tokenizer(cfg.model), load_examples(cfg.data, "train")
        gdist.barrier()
        base = _status_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current RSS
        trainer = tr.GRPOTrainer(cfg, ctx)
        out["built_peak_rise_mib"] = _status_mib("VmHWM") - base
        trainer.train_step()
        out["after_step_peak_rise_mib"] = _status_mib("VmHWM") - base
        out["rss_after_step_mib"] = _status_mib("VmRSS")
    else:
        trainer = tr.GRPOTrainer(cfg, ctx)
        trainer.train_step()  # AdamW state exists now
        eng = trainer.engine
        # a second step's backward without its optimizer step keeps the gradients for counting
        step = eng.step
        eng.step = lambda skip=False: None
        try:
            trainer.train_step()
        except Exception:
            pass  # metrics of the skipped step may not parse; the gradients are what we want
        eng.step = step
        params = [p for p in eng.module.parameters()]
        from torch.distributed.tensor import DTensor
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731  (FSDP2: this rank's shard)
        nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)  # noqa: E731
        out["params_mib"] = nbytes(params) / 2**20
        out["grads_mib"] = nbytes([p.grad for p in params if p.grad is not None]) / 2**20
        out["optimizer_mib"] = nbytes([v for s in eng.optimizer.state.values() for v in s.values()
                                       if torch.is_tensor(v)]) / 2**20
        out["total_mib"] = out["params_mib"] + out["grads_mib"] + out["optimizer_mib"]
    print_rank_results(out, ctx)
    gdist.cleanup()


def run(world, extra, env):
    return run_worker(__file__, world, extra, 29600 + os.getpid() % 300, env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["states", "load", "both"], default="both")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--backend", default="fsdp", choices=["fsdp", "fsdp2"], help="distributed.backend")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--all-ranks-read", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from bench_common import tiny_override
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    work = tempfile.mkdtemp(prefix="bench_mem_model_")
    cfg = load_config(None, [tiny_override(args.hidden, args.layers, args.vocab).replace("bpe", "char")])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work)
    tok.save_pretrained(work)
    del model
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    backend = ["--backend", args.backend]
    summary = dict(backend=args.backend, params=n_params, model_mib=round(n_params * 4 / 2**20, 1))
    print(f"model: {n_params / 1e6:.1f}M params ({n_params * 4 / 2**20:.0f} MiB fp32), hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}")
    if args.part in ("states", "both"):
        one = run(1, ["--part", "states", "--model-dir", work] + backend, env)
        two = run(2, ["--part", "states", "--model-dir", work] + backend, env)
        print(f"{'':10} {'params MiB':>11} {'grads MiB':>10} {'AdamW MiB':>10} {'total MiB':>10}")
        for name, r in [("1 rank", one[0])] + [(f"2 ranks r{i}", r) for i, r in enumerate(two)]:
            print(f"{name:10} {r['params_mib']:11.1f} {r['grads_mib']:10.1f} {r['optimizer_mib']:10.1f} "
                  f"{r['total_mib']:10.1f}")
        ratio = max(r["total_mib"] for r in two) / one[0]["total_mib"]
        print(f"per-rank states at 2 ranks / 1 rank: {ratio:.3f}")
        summary["states"] = dict(one_rank=one, two_ranks=two, ratio_2_over_1=round(ratio, 4))
    if args.part in ("load", "both"):
        rows = {}
        for name, flag in (("rank 0 reads", []), ("all ranks read", ["--all-ranks-read"])):
            rows[name] = run(2, ["--part", "load", "--model-dir", work] + flag + backend, env)
        print(f"{'2 ranks, one node':18} {'built: r0 / r1 / sum MiB':>26} {'after 1 step: r0 / r1 / sum MiB':>33}")
        for name, r in rows.items():
            b = [x["built_peak_rise_mib"] for x in r]
            s = [x["after_step_peak_rise_mib"] for x in r]
            print(f"{name:18} {b[0]:8.0f} {b[1]:7.0f} {sum(b):8.0f}   {s[0]:12.0f} {s[1]:7.0f} {sum(s):8.0f}")
        summary["load"] = rows
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

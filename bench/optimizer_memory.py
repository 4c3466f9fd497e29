"""Optimizer state per rank: optimizer=adamw vs adamw_8bit at 1 and 2 ranks, on SmolLM2-135M-Instruct (or a tiny
model with --tiny). After one real GRPO step (the state exists), each rank counts the bytes of its live optimizer
state tensors (grpo_dist.optim8bit.state_bytes) and the elements of its trainable parameters (its FSDP shards at
2 ranks; under FSDP2 the DTensors' local shards), and reports bytes per parameter and MiB per rank. Then what a
checkpoint's optimizer part costs: optimizer.state_dict()'s tensors on each rank (state_dict B/p: what FSDP's and
DCP's gathering would take from this rank at once), the full optimizer state gathered on rank 0 (gathered B/p, over
the parameters of all ranks), optimizer.pt of a full checkpoint and the DCP directory of a sharded one (model
included). The last line is one JSON object.

    python bench/optimizer_memory.py            # SmolLM2 (python -m grpo_dist.tools.smollm2 builds it), ~5 min
    python bench/optimizer_memory.py --tiny     # a tiny Qwen2, seconds
    python bench/optimizer_memory.py --backend fsdp2   # distributed.backend (default fsdp: 1 rank is the local engine)

Runs torchrun itself; needs bitsandbytes (pip install 'grpo_dist[adamw8bit]').
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


def _overrides(model: str, optimizer: str, backend: str) -> list[str]:
    return [model, f"optimizer={optimizer}", f"distributed.backend={backend}", "beta=0", "reward_workers=0",
            "report_to=[]", "progress_bar=false",
            "save_final=false", "num_generations=2", "prompts_per_rank=1", "max_completion_length=4",
            "micro_batch_size=2", "learning_rate=1e-5", "log_completions=0", "health.enabled=false",
            f"output_dir={tempfile.mkdtemp(prefix='bench_optim_')}",
            "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]"]


def worker(args):
    import torch

    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    from grpo_dist.optim8bit import state_bytes
    from grpo_dist.trainer import GRPOTrainer
    torch.set_num_threads(1)
    ctx = gdist.init_distributed(600, 1)
    trainer = GRPOTrainer(load_config(None, _overrides(args.model, args.optimizer, args.backend)), ctx)
    trainer.train_step()
    opt = trainer.engine.optimizer

    def local(p):  # this rank's elements: a DTensor's (FSDP2) numel() is the whole parameter's
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    params = sum(local(p) for g in opt.param_groups for p in g["params"])
    eight = sum(local(p) for p, st in opt.state.items() if st.get("state1", torch.empty(0)).dtype == torch.uint8)
    out = {"rank": ctx.rank, "params": params, "state_bytes": state_bytes(opt), "eight_bit_params": eight}
    out.update(_checkpoint_figures(trainer, ctx))
    print_rank_results(out, ctx)
    gdist.cleanup()


def _checkpoint_figures(trainer, ctx) -> dict:
    """Bytes of what a checkpoint's optimizer part costs: optimizer.state_dict() on this rank (what the fp32-moment
    layout materialised at once on the device), the full state dict gathered on rank 0 (host), and the files of a
    full and a sharded checkpoint (optimizer.pt; the DCP directory, model included)."""
    from pathlib import Path

    from grpo_dist.optim8bit import nested_tensor_bytes
    opt = trainer.engine.optimizer
    out = {"state_dict_bytes": nested_tensor_bytes(opt.state_dict()["state"])}
    _, optim_sd = trainer.engine.gather_full_state()
    out["gathered_bytes"] = nested_tensor_bytes(optim_sd["state"]) if optim_sd is not None else None
    del optim_sd
    from grpo_dist import distributed as gdist
    where = Path(gdist.broadcast_object(tempfile.mkdtemp(prefix="bench_optim_ckpt_") if ctx.is_main else None))
    for fmt in ("full", "sharded"):
        path = trainer.checkpointer.with_target(output_dir=str(where / fmt), save_format=fmt).save()
        if ctx.is_main:
            files = [path / "optimizer.pt"] if fmt == "full" else list((path / "sharded").rglob("*"))
            out[f"{fmt}_optimizer_file_bytes"] = sum(f.stat().st_size for f in files if f.is_file())
    return out


def run(world: int, model: str, optimizer: str, backend: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    return run_worker(__file__, world, ["--model", model, "--optimizer", optimizer, "--backend", backend],
                      29650 + os.getpid() % 300, env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 (hidden 256, 4 layers) instead of SmolLM2")
    ap.add_argument("--backend", default="fsdp", choices=("fsdp", "fsdp2"), help="distributed.backend")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.tiny:
        from bench_common import tiny_override
        model, name = tiny_override(256, 4, 1024), "tiny qwen2 hidden 256"
    else:
        from grpo_dist.tools import smollm2
        model, name = f"model.name_or_path={smollm2.build_model_dir()}", "SmolLM2-135M-Instruct"
    summary: dict = {"model": name, "backend": args.backend}
    print(f"{'':22} {'params/rank':>12} {'state MiB':>10} {'bytes/param':>12} {'8-bit share':>12} "
          f"{'state_dict B/p':>14} {'gathered B/p':>12} {'optimizer.pt MiB':>16} {'sharded dir MiB':>15}")
    for optimizer in ("adamw", "adamw_8bit"):
        for world in (1, 2):
            rows = run(world, model, optimizer, args.backend)
            everyone = sum(x["params"] for x in rows)
            for r in rows:
                per = r["state_bytes"] / max(r["params"], 1)
                label = f"{optimizer} {world} rank(s) r{r['rank']}"
                gathered = r.get("gathered_bytes")
                files = (r.get("full_optimizer_file_bytes"), r.get("sharded_optimizer_file_bytes"))
                print(f"{label:22} {r['params']:12d} {r['state_bytes'] / 2**20:10.2f} {per:12.3f} "
                      f"{r['eight_bit_params'] / max(r['params'], 1):12.3f} "
                      f"{r['state_dict_bytes'] / max(r['params'], 1):14.3f} "
                      f"{'' if gathered is None else round(gathered / everyone, 3):>12} "
                      f"{'' if files[0] is None else round(files[0] / 2**20, 2):>16} "
                      f"{'' if files[1] is None else round(files[1] / 2**20, 2):>15}", flush=True)
                for key in ("state_dict_bytes", "gathered_bytes", "full_optimizer_file_bytes",
                            "sharded_optimizer_file_bytes"):
                    if r.get(key) is not None:
                        summary[f"{optimizer}_{world}rank_r{r['rank']}_{key}"] = r[key]
                summary[f"{optimizer}_{world}rank_r{r['rank']}_state_mib"] = round(r["state_bytes"] / 2**20, 2)
                summary[f"{optimizer}_{world}rank_r{r['rank']}_bytes_per_param"] = round(per, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Asynchronous GRPO (issue 23, docs/async.md): 1 trainer + 1 rollout rank (rollout_ranks=1) at max_staleness
0, 1, 2 against 2 colocated ranks (--colocated-ranks), the same prompts per step, on bench/long_cot.py's
long-tailed completion lengths (forced by EOS placement, its ForcedLengths), a few steps each (torchrun, gloo,
one thread per rank).

    python bench/async.py --quick              # the tiny model, lengths median 20 / p95 90 / cap 128
    python bench/async.py --model DIR          # SmolLM2-135M-Instruct's HF directory, lengths 200 / 900 / 1024
    python bench/async.py --project            # the 8-GPU projection only (no run; its inputs are flags)

Every configuration trains the same P prompts x G rows per step: colocated as C ranks x P/C prompts (C =
--colocated-ranks, 2 by default; bench/gpu_check.sh's one-GPU stage takes 1), async as one trainer of P prompts
whose rows the rollout rank samples. Every job runs with GRPO_DIST_SHARE_GPU=1: on a machine with fewer GPUs than
ranks (the one-GPU check) the ranks share GPU 0 over gloo (grpo_dist.distributed.cuda_device); elsewhere it
changes nothing. Row i of step s ends at lengths(P*G, seed=s)[i] (the
same multiset of lengths per step in every configuration; the worker checks completion_length_mean against it).

Per configuration it prints: completion tokens trained per second (all steps: tokens / the trainer's train() wall
time; "full": the steps after the first k + 1, tokens / their step_time_s), the trainer's and the rollout rank's
idle fractions over all steps and once the pipeline is full (steps s >= k + 1), weight-broadcast time per step and
bytes per version sent, and the lag (async/lag_mean, async/lag_max). Idle fractions: the trainer's is
async/trainer_idle_fraction (time waiting for completions over step time; weighted by step_time_s); the rollout
rank's is taken per batch from the cumulative idle / busy seconds every completion message carries (the logged
async/rollout_idle_fraction is that cumulative ratio, so it cannot isolate the steps after the fill). A rollout
rank's idle time includes receiving new weights.

Then the projection (projection()): a pipeline step is max(rollout, train) + the unhidden weight sync, a colocated
one rollout + train, from per-token phase times; printed with the arithmetic for 8 GPUs (4+4, 6+2) on the 0.5B and
7B configs, plus the same arithmetic on this run's measured phase times (1+1 vs the colocated ranks) next to the
measured figure. Assumptions: bench/README.md (async section), docs/async.md. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import tiny_override  # noqa: E402
from long_cot import ForcedLengths, lengths  # noqa: E402  (the long-tailed lengths and the forced-EOS decoder)

ROOT = Path(__file__).resolve().parent.parent


def step_targets(args, step: int) -> list[int]:
    """The completion lengths of every row of step `step` (all ranks), reproducible."""
    return lengths(args.prompts * args.num_generations, args.median, args.p95, args.cap, seed=step)


# ------------------------------------------------------------------------------------------ one torchrun job
def worker(args) -> None:
    import torch

    from grpo_dist import async_rollout, rollout_engines
    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    from grpo_dist.trainer import GRPOTrainer

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    k = args.staleness
    sampling_ranks = 1 if k >= 0 else world  # async: the one rollout rank samples every row
    overrides = [
        f"num_generations={args.num_generations}", f"prompts_per_rank={args.prompts // (world if k < 0 else 1)}",
        f"max_completion_length={args.cap}", f"data.max_prompt_length={args.max_prompt_length}", f"beta={args.beta}",
        "num_iterations=1", f"max_steps={args.steps}", "reward_workers=0", "report_to=[jsonl]",
        "progress_bar=false", "save_final=false", "save_steps=0", f"output_dir={args.out}/run", "learning_rate=1e-6",
        "distributed.num_threads=1", "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]",
        "rollout_engine=lean", "temperature=1.0", "distributed.timeout_s=600"]
    if args.mixed_precision:  # the GPU check: bf16 compute (trainer and rollout replica), fp32 master weights
        overrides.append(f"distributed.mixed_precision={args.mixed_precision}")
    if k >= 0:
        overrides += ["rollout_ranks=1", f"max_staleness={k}"]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    else:
        overrides.append(tiny_override(args.tiny_hidden, args.tiny_layers, 1024).replace(
            "}", f", max_position_embeddings: {args.max_prompt_length + args.cap}}}"))
    cfg = load_config(None, overrides)
    ctx = gdist.init_distributed(cfg.distributed.timeout_s, 1)

    # each generate() call is one step's rows of this sampling rank: force their lengths (ForcedLengths follows the
    # rows across generation chunks and compaction); the EOS ids are the ones the sampler itself uses
    from grpo_dist import rollout
    eos: list[int] = []
    eos_ids = rollout.eos_token_ids

    def record_eos(model, tokenizer):
        eos[:] = eos_ids(model, tokenizer)
        return list(eos)
    rollout.eos_token_ids = record_eos
    calls = [0]
    make = rollout_engines.make_decoder
    slot = 0 if k >= 0 else rank

    def forced(*a, **kw):
        rows = args.prompts * args.num_generations // sampling_ranks
        targets = step_targets(args, calls[0])[slot * rows:(slot + 1) * rows]
        calls[0] += 1
        return ForcedLengths(make(*a, **kw), targets, eos)
    rollout_engines.make_decoder = forced
    out: dict = {"rank": rank}
    seen: list = []  # trainer: (batch, cumulative idle s, cumulative busy s) of each completion message
    if k >= 0:
        roles, ctx = async_rollout.setup(cfg, ctx)
        if not roles.is_trainer:
            out.update(served=async_rollout.serve(cfg, roles, ctx), generate_calls=calls[0])
            _finish(args, out, gdist)
        receive = async_rollout.recv_obj

        def recv(src, roles_, what):
            msg = receive(src, roles_, what)
            if isinstance(msg, dict) and "idle_s" in msg:
                seen.append((msg["batch"], msg["idle_s"], msg["busy_s"]))
            return msg
        async_rollout.recv_obj = recv
    trainer = GRPOTrainer(cfg, ctx)
    eos[:] = eos or trainer.sampling_spec().eos_ids  # colocated: the trainer bound eos_token_ids at its import
    gdist.barrier()
    t0 = time.perf_counter()
    code = trainer.train()
    out.update(code=code, train_s=time.perf_counter() - t0, generate_calls=calls[0])
    if ctx.is_main:
        out["metrics"] = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl")]
        out["rollout_cumulative"] = seen
    del trainer
    _finish(args, out, gdist)


def _finish(args, out: dict, gdist=None) -> None:
    """This rank's figures to its file, then out without the interpreter's teardown (as bench/long_cot.py)."""
    import gc
    with open(Path(args.out) / f"rank{out['rank']}.json", "w") as f:
        json.dump(out, f)
    gc.collect()
    if gdist is not None:
        gdist.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
# ----------------------------------------------------------------------------------------------------- driver
def run_config(args, k: int) -> dict:
    """One configuration (k < 0: --colocated-ranks colocated ranks; else 1 trainer + 1 rollout rank at
    max_staleness k) in its own torchrun job; its figures."""
    name = "colocated" if k < 0 else f"async_k{k}"
    nproc = args.colocated_ranks if k < 0 else 2
    # GRPO_DIST_SHARE_GPU: two ranks on a one-GPU machine share it (gloo); a no-op with a GPU per rank or none
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPO_DIST_SHARE_GPU="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="bench_async_") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", str(Path(__file__).resolve()), "--worker", "--out", out,
               "--staleness", str(k), "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--num-generations", str(args.num_generations), "--median", str(args.median), "--p95",
               str(args.p95), "--cap", str(args.cap), "--max-prompt-length", str(args.max_prompt_length),
               "--tiny-hidden", str(args.tiny_hidden), "--tiny-layers", str(args.tiny_layers), "--beta", str(args.beta)]
        if args.model:
            cmd += ["--model", args.model]
        if args.mixed_precision:
            cmd += ["--mixed-precision", args.mixed_precision]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{name}: torchrun exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]
    res = summarise(args, k, ranks)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def summarise(args, k: int, ranks: list[dict]) -> dict:
    """The figures of one configuration from its ranks' files (rank 0 is a trainer in every configuration; a
    colocated configuration's ranks each sample and train an equal share of the rows)."""
    main = ranks[0]
    if main["code"] != 0:
        raise RuntimeError(f"k={k}: the trainer exited {main['code']}")
    m = main["metrics"]
    steps = len(m)
    tokens = [sum(step_targets(args, s)) for s in range(steps)]
    for s, row in enumerate(m):  # the forced lengths held: every trained row of every step
        if abs(row["completion_length_mean"] - tokens[s] / (args.prompts * args.num_generations)) > 1e-6:
            raise RuntimeError(f"k={k} step {s}: completion_length_mean {row['completion_length_mean']} != forced "
                               f"{tokens[s] / (args.prompts * args.num_generations)}")
    full = max(k, 0) + 1  # the pipeline is full from step k + 1 on (colocated: after the first step)
    if steps <= full:
        raise RuntimeError(f"--steps {args.steps}: no step after the first {full} (the pipeline never is full)")
    step_s = [row["step_time_s"] for row in m]
    res = {"steps": steps, "full_from_step": full, "completion_tokens": sum(tokens),
           "train_s": round(main["train_s"], 3),
           "tokens_per_s": round(sum(tokens) / main["train_s"], 2),
           "tokens_per_s_full": round(sum(tokens[full:]) / sum(step_s[full:]), 2),
           "step_time_s": [round(x, 3) for x in step_s],
           "rollout_s_per_step": [round(row["time_rollout_s"], 3) for row in m]}
    if k < 0:  # the colocated phase times: what the projection takes as this machine's per-token figures
        res["ranks"] = len(ranks)
        rows_per_rank = args.prompts * args.num_generations // len(ranks)
        rank_tokens = [sum(step_targets(args, s)[:rows_per_rank]) for s in range(steps)]  # rank 0's rows
        roll = sum(row["time_rollout_s"] for row in m[1:])
        res.update(rollout_s_per_token=roll / sum(rank_tokens[1:]),
                   train_s_per_token=(sum(step_s[1:]) - roll) / sum(rank_tokens[1:]),
                   replica_sync_s_per_step=round(sum(row.get("time_weight_sync_s", 0.0) for row in m) / steps, 4))
        return res
    versions = 1 + max(0, steps - k - 1)  # version 0 before batch 0, then one per batch sent after a step
    idle_t = [row["async/trainer_idle_fraction"] * row["step_time_s"] for row in m]
    cum = sorted(main["rollout_cumulative"])  # (batch, idle, busy): cumulative on the rollout rank
    per = [(i1 - i0, b1 - b0) for (_, i0, b0), (_, i1, b1) in zip([(0, 0.0, 0.0)] + cum[:-1], cum)]
    res.update(
        staleness=k,
        trainer_idle_fraction=round(sum(idle_t) / sum(step_s), 4),
        trainer_idle_fraction_full=round(sum(idle_t[full:]) / sum(step_s[full:]), 4),
        rollout_idle_fraction=round(sum(i for i, _ in per) / sum(i + b for i, b in per), 4),
        rollout_idle_fraction_full=round(sum(i for i, _ in per[full:]) / sum(i + b for i, b in per[full:]), 4),
        rollout_idle_fraction_logged_last=round(m[-1]["async/rollout_idle_fraction"], 4),
        weight_sync_s_per_step=round(sum(row["async/weight_sync_s"] for row in m) / steps, 4),
        weight_sync_bytes_per_version=sum(row["async/weight_sync_bytes"] for row in m) / versions,
        weight_sync_bytes_per_step=[row["async/weight_sync_bytes"] for row in m],
        lag_mean=round(sum(row["async/lag_mean"] for row in m) / steps, 4),
        lag_max=max(row["async/lag_max"] for row in m),
        lag_per_step=[row["async/lag_max"] for row in m],
        dropped=sum(row["async/dropped"] for row in m))
    return res


def describe(name: str, r: dict) -> str:
    line = (f"{name}: {r['completion_tokens']} completion tokens in {r['train_s']:.1f} s = {r['tokens_per_s']:.1f} "
            f"tokens/s (full pipeline, steps >= {r['full_from_step']}: {r['tokens_per_s_full']:.1f}); step times "
            f"{r['step_time_s']} s")
    if "staleness" not in r:
        return line + (f"; rollout {r['rollout_s_per_token'] * 1e3:.3f} ms/token, train "
                       f"{r['train_s_per_token'] * 1e3:.3f} ms/token per rank")
    return line + (f"; idle trainer {r['trainer_idle_fraction']:.1%} / rollout {r['rollout_idle_fraction']:.1%} "
                   f"(full: {r['trainer_idle_fraction_full']:.1%} / {r['rollout_idle_fraction_full']:.1%}); "
                   f"weight sync {r['weight_sync_s_per_step'] * 1e3:.1f} ms/step, "
                   f"{r['weight_sync_bytes_per_version'] / 2**20:.2f} MiB/version; lag mean {r['lag_mean']:.2f} max "
                   f"{r['lag_max']:g} (per step {r['lag_per_step']}), dropped {r['dropped']:g}")


# ------------------------------------------------------------------------------------------------ projection
# Public shapes of the configs' models (config.json of Qwen2.5-0.5B / 7B-Instruct): parameters, layers, KV heads,
# head dim. The rest of each config (rows, lengths, beta) comes from configs/*.yaml.
MODELS = {
    "qwen2.5_0.5b_gsm8k": dict(config="configs/qwen2.5_0.5b_gsm8k.yaml", params=0.494e9, layers=24, kv_heads=2,
                               head_dim=64),
    "qwen2.5_7b_multinode": dict(config="configs/qwen2.5_7b_multinode.yaml", params=7.62e9, layers=28, kv_heads=4,
                                 head_dim=128),
}


def phase_inputs(args, name: str) -> dict:
    """Per-step work of a config on 8 GPUs and the per-GPU phase costs the projection takes (flags override)."""
    from grpo_dist.config import load_config
    spec = MODELS[name]
    cfg = load_config(str(ROOT / spec["config"]), [])
    rows = 64 * cfg.num_generations  # both configs: 64 prompts per step (their comments)
    L = cfg.max_completion_length
    ls = lengths(rows, 200 * L / 1024, 900 * L / 1024, L)  # long_cot's long tail, scaled to the config's cap
    P = spec["params"]
    context = cfg.data.max_prompt_length / 2 + sum(ls) / len(ls) / 2  # mean KV length read per decode step
    kv_bytes = 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 2 * context  # K and V, bf16
    train_flops = (6 + (2 if cfg.beta else 0)) * P  # forward + backward, + the reference forward when beta > 0
    return dict(
        rows=rows, mean_len=sum(ls) / len(ls), longest=max(ls), tokens=sum(ls),
        # a decode step reads every weight once (bf16) whatever the rows: memory-bound
        decode_step_s=2 * P / (args.hbm_bytes_s * args.hbm_efficiency),
        # and per row: its 2P FLOPs and its KV cache
        decode_row_s=2 * P / (args.peak_flops * args.decode_mfu) + kv_bytes / (args.hbm_bytes_s * args.hbm_efficiency),
        train_s_per_token=train_flops / (args.peak_flops * args.train_mfu),
        sync_bytes=2 * P, sync_bytes_s=args.sync_bytes_s)


def project(inp: dict, rollout_gpus: int, trainer_gpus: int) -> dict:
    """Step times of one split; rollout_gpus = 0: colocated on trainer_gpus GPUs. Generation: the batch decodes
    until its longest row ends, each decode step reading every weight once (longest x decode_step_s, the same on
    any number of GPUs), plus each generated token's own work spread over the GPUs (tokens / GPUs x decode_row_s;
    decode compaction drops finished rows); training: tokens x train_s_per_token / GPUs; the weight sync is not
    hidden (the trainers broadcast after the optimizer step; the rollout ranks take it while they sample, but the
    transfer itself is on the trainers' path)."""
    if rollout_gpus == 0:
        g = trainer_gpus
        roll = inp["longest"] * inp["decode_step_s"] + inp["tokens"] / g * inp["decode_row_s"]
        train = inp["tokens"] * inp["train_s_per_token"] / g
        return dict(rollout_s=roll, train_s=train, sync_s=0.0, step_s=roll + train,
                    arithmetic=f"{roll:.2f} + {train:.2f}")
    roll = inp["longest"] * inp["decode_step_s"] + inp["tokens"] / rollout_gpus * inp["decode_row_s"]
    train = inp["tokens"] * inp["train_s_per_token"] / trainer_gpus
    sync = inp["sync_bytes"] / inp["sync_bytes_s"]
    step = max(roll, train) + sync
    return dict(rollout_s=roll, train_s=train, sync_s=sync, step_s=step,
                arithmetic=f"max({roll:.2f}, {train:.2f}) + {sync:.3f}")


def projection(args, measured: dict | None = None) -> dict:
    """The table: per config, colocated 8 vs 4+4 and 6+2 (and, with a measured run, this machine's 1+1 vs the colocated
    ranks)."""
    out: dict = {}
    print("projection (8 GPUs; step = max(rollout, train) + unhidden sync vs colocated rollout + train; inputs: "
          "bench/README.md 'Asynchronous GRPO'):", flush=True)
    for name in MODELS:
        inp = phase_inputs(args, name)
        print(f"  {name}: {inp['rows']} rows, mean length {inp['mean_len']:.0f}, longest {inp['longest']} "
              f"({inp['tokens']} tokens/step); decode {inp['decode_step_s'] * 1e3:.3f} ms/step + "
              f"{inp['decode_row_s'] * 1e6:.2f} us/token/GPU; train {inp['train_s_per_token'] * 1e6:.2f} us/token/GPU; "
              f"sync {inp['sync_bytes'] / 1e9:.2f} GB at {inp['sync_bytes_s'] / 1e9:.0f} GB/s", flush=True)
        colo = project(inp, 0, 8)
        rows = {"colocated_8": colo}
        for t, r in ((4, 4), (2, 6), (6, 2)):  # trainer GPUs + rollout GPUs
            rows[f"async_{t}t+{r}r"] = project(inp, r, t)
        for split, p in rows.items():
            p["tokens_per_s"] = inp["tokens"] / p["step_s"]
            p["speedup"] = colo["step_s"] / p["step_s"]
            print(f"    {split:13s} step = {p['arithmetic']:26s} = {p['step_s']:7.2f} s  "
                  f"{p['tokens_per_s']:9.0f} tokens/s  x{p['speedup']:.2f} vs colocated", flush=True)
        out[name] = {"inputs": inp, "splits": {k: {x: (round(v, 4) if isinstance(v, float) else v)
                                                   for x, v in p.items()} for k, p in rows.items()}}
    if measured:  # the same arithmetic on this run's measured per-token phase times (linear: rows x length)
        c = measured["colocated"]
        tok = c["completion_tokens"] / c["steps"]
        colo_s = tok / c["ranks"] * (c["rollout_s_per_token"] + c["train_s_per_token"])
        lines = {}
        for k, r in measured.items():
            if k == "colocated":
                continue
            sync = r["weight_sync_s_per_step"]
            step = max(tok * c["rollout_s_per_token"], tok * c["train_s_per_token"]) + sync
            lines[k] = dict(projected_tokens_per_s=tok / step, measured_tokens_per_s_full=r["tokens_per_s_full"])
            print(f"  this machine, {k} (1+1) vs {c['ranks']} colocated: step = "
                  f"max({tok * c['rollout_s_per_token']:.2f}, "
                  f"{tok * c['train_s_per_token']:.2f}) + {sync:.3f} = {step:.2f} s ({tok / step:.1f} tokens/s; "
                  f"measured {r['tokens_per_s_full']:.1f}) vs {colo_s:.2f} s ({tok / colo_s:.1f}; measured "
                  f"{c['tokens_per_s_full']:.1f})", flush=True)
        out["this_machine"] = lines
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="SmolLM2-135M-Instruct's HF directory (the real-model run)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, lengths median 20 / p95 90 / cap 128")
    ap.add_argument("--project", action="store_true", help="only the 8-GPU projection (no run)")
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration (more than max staleness + 1)")
    ap.add_argument("--staleness", default="0,1,2", help="the max_staleness values of the async configurations")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step, all ranks (even)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--length-cap", type=int, default=0, help="cap the lengths at N, median and p95 scaled by "
                    "N / 1024 (0: 1024, --quick 128)")
    ap.add_argument("--max-prompt-length", type=int, default=128)
    ap.add_argument("--beta", type=float, default=0.04, help="the KL coefficient of every configuration (0: no "
                    "reference pass, TRL's default; it moves the trainer's share of the step)")
    ap.add_argument("--colocated-ranks", type=int, default=2, help="ranks of the colocated reference (they split "
                    "--prompts evenly)")
    ap.add_argument("--mixed-precision", choices=["bf16", "fp16"], help="distributed.mixed_precision of every "
                    "configuration (default: none, fp32 compute)")
    ap.add_argument("--tiny-hidden", type=int, default=128)
    ap.add_argument("--tiny-layers", type=int, default=4)
    g = ap.add_argument_group("projection inputs (H100 SXM figures by default; replace with measured ones)")
    g.add_argument("--hbm-bytes-s", type=float, default=3.35e12, help="GPU memory bandwidth, bytes/s")
    g.add_argument("--hbm-efficiency", type=float, default=0.6, help="share of it a decode step reaches")
    g.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 FLOP/s per GPU")
    g.add_argument("--train-mfu", type=float, default=0.35, help="model FLOPs utilisation of training")
    g.add_argument("--decode-mfu", type=float, default=0.2, help="FLOPs utilisation of the per-row decode work")
    g.add_argument("--sync-bytes-s", type=float, default=100e9, help="weight broadcast bandwidth (NCCL within a "
                   "node), bytes/s")
    # worker arguments (one torchrun job)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--median", type=float, default=200, help=argparse.SUPPRESS)
    ap.add_argument("--p95", type=float, default=900, help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=int, default=1024, help=argparse.SUPPRESS)
    return ap


def check_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """A measured run's arguments, refused where they cannot be right; sets the lengths (median, p95, cap) and
    returns the max_staleness values."""
    if args.prompts % args.colocated_ranks:
        ap.error(f"--prompts {args.prompts} must split evenly over --colocated-ranks {args.colocated_ranks}")
    ks = [int(x) for x in args.staleness.split(",")]
    cap = args.length_cap or (128 if args.quick else 1024)
    args.median, args.p95, args.cap = 200 * cap / 1024, 900 * cap / 1024, cap
    if args.steps <= max(ks) + 1:
        ap.error(f"--steps must exceed max staleness + 1 = {max(ks) + 1} (steps after the pipeline is full)")
    return ks


def configure(argv: list[str]) -> tuple[argparse.Namespace, list[int]]:
    """The arguments of a measured run from a command line, checked, and its max_staleness values: for callers
    that run the configurations themselves (bench/gpu_check.py's async stage)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    return args, check_run_args(ap, args)


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        args.staleness = int(args.staleness)
        return worker(args)
    if args.project:
        print(json.dumps({"projection": projection(args)}), flush=True)
        return
    if not args.quick and not args.model:
        ap.error("--model DIR (SmolLM2-135M-Instruct), --quick or --project")
    ks = check_run_args(ap, args)
    ls = [x for s in range(args.steps) for x in step_targets(args, s)]
    print(f"lengths: {args.prompts * args.num_generations} rows/step x {args.steps} steps, median "
          f"{sorted(ls)[len(ls) // 2]}, p95 {sorted(ls)[int(0.95 * len(ls))]}, max {max(ls)}, mean "
          f"{sum(ls) / len(ls):.1f}", flush=True)
    runs = {}
    for k in [-1] + ks:
        name = "colocated" if k < 0 else f"async_k{k}"
        runs[name] = run_config(args, k)
        print(describe(name, runs[name]), flush=True)
    proj = projection(args, runs)
    print(json.dumps({"model": args.model or "tiny", "steps": args.steps, "prompts": args.prompts,
                      "num_generations": args.num_generations, "beta": args.beta,
                      "lengths": dict(median=args.median, p95=args.p95, cap=args.cap),
                      "load_average": round(os.getloadavg()[0], 2), "results": runs, "projection": proj}),
          flush=True)


if __name__ == "__main__":
    main()

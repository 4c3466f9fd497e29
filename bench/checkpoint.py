"""Checkpoint figures: save / load time and rank-0 peak memory, full-state vs sharded (DCP), on a ~20M-parameter
Qwen2 with 2 CPU ranks; and the time from SIGTERM to exit of a 2-rank torchrun job.

    .venv/bin/python bench/checkpoint.py [--repeats 3] [--skip-sigterm]

Memory is the rise of resident memory above what the process held just before the operation (sampled every 2 ms
in a thread), so it shows what a save/load adds on top of training, not the process baseline.
Save time includes the manifest (fsync + sha256 of every file, split over the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ~21M parameters: 7 layers of hidden 512 (GQA 8/2 heads, MLP 1536) + a char vocabulary.
MODEL = ("model.tiny={architecture: qwen2, hidden_size: 512, num_hidden_layers: 7, num_attention_heads: 8, "
         "num_key_value_heads: 2, intermediate_size: 1536, tokenizer: char}")
TRAIN = [MODEL, "beta=0", "prompts_per_rank=1", "num_generations=2", "max_completion_length=4", "reward_workers=0",
         "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]", "progress_bar=false", "report_to=[]",
         "max_steps=1000", "learning_rate=1e-5"]


class RssPeak:
    """Peak resident memory (MiB) above the level at entry, sampled in a background thread."""
    page = os.sysconf("SC_PAGE_SIZE")

    @classmethod
    def rss(cls) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * cls.page / 2**20

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())
        self.rise = self.peak - self.base


def _worker(rank, world, port, out_dir, fmt, repeats, result_file):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    from grpo_dist import checkpoint as ckpt
    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    from grpo_dist.trainer import GRPOTrainer

    cfg = load_config(None, TRAIN + [f"output_dir={out_dir}"])
    ctx = gdist.init_distributed(600)
    tr = GRPOTrainer(cfg, ctx)
    tr.train_step()  # the optimizer state exists
    n_params = sum(p.numel() for p in tr.gen_model.parameters())
    rows = []
    for r in range(repeats):  # memory: the first round counts (a fresh process; later rounds reuse freed pages)
        out = Path(out_dir) / f"{fmt}{r}"
        gdist.barrier()
        with RssPeak() as mem:
            t0 = time.perf_counter()
            path = tr.checkpointer.with_target(output_dir=str(out), save_format=fmt).save()
            save_s = time.perf_counter() - t0
        save_mem = mem.rise
        gdist.barrier()
        with RssPeak() as mem:
            t0 = time.perf_counter()
            ckpt.load_checkpoint(path, tr.engine, ctx, tr.gen_model)
            load_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        rows.append((save_s, save_mem, load_s, mem.rise, size))
    gdist.cleanup()
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump({"params": n_params, "rows": rows}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_save_load(repeats: int) -> None:
    import torch.multiprocessing as mp
    results = {}
    for fmt in ("full", "sharded"):  # each in fresh processes, so that memory readings are comparable
        with tempfile.TemporaryDirectory() as tmp:
            res = os.path.join(tmp, "result")
            mp.start_processes(_worker, args=(2, _free_port(), tmp, fmt, repeats, res), nprocs=2,
                               start_method="spawn")
            results[fmt] = [json.load(open(f"{res}.{r}")) for r in range(2)]
    print(f"model: {results['full'][0]['params'] / 1e6:.1f}M parameters, 2 ranks (gloo, CPU); times: median of "
          f"{repeats}, slower rank; memory: first save/load in a fresh process")
    print("| format | checkpoint size | save s | load s | rank-0 RSS rise: save | load "
          "| rank-1 RSS rise: save | load |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt, (r0, r1) in results.items():
        a, b = r0["rows"], r1["rows"]

        def med(i, a=a, b=b):
            return max(statistics.median(x[i] for x in a), statistics.median(x[i] for x in b))
        print(f"| {fmt} | {a[0][4] / 2**20:.0f} MiB | {med(0):.2f} | {med(2):.2f} | {a[0][1]:.0f} MiB | "
              f"{a[0][3]:.0f} MiB | {b[0][1]:.0f} MiB | {b[0][3]:.0f} MiB |")


def bench_sigterm() -> None:
    """torchrun job of the same model; SIGTERM to torchrun once step 1 is logged; time until torchrun exits."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "bench"),
                                                                                 os.environ.get("PYTHONPATH", "")]))
        env.pop("GRPO_DIST_FAULT", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", "-m", "grpo_dist.train", f"output_dir={out}",
               "report_to=[jsonl]", "save_format=full"] + [a for a in TRAIN if not a.startswith("report_to")]
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            if p.poll() is not None:
                raise RuntimeError(p.stderr.read()[-3000:])
            time.sleep(0.01)
        seen: dict[str, float] = {}

        def watch():  # when the trainer reports that its checkpoint is written
            for line in p.stdout:
                if "stop requested" in line:
                    seen["saved"] = time.perf_counter()
                seen.setdefault("out", "")
                seen["out"] += line
        reader = threading.Thread(target=watch, daemon=True)
        reader.start()
        t0 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        p.stderr.read()  # drain (the trainer's warnings) until torchrun exits
        p.wait(timeout=300)
        dt = time.perf_counter() - t0
        reader.join()
        stdout = seen.get("out", "")
        steps = [json.loads(x) for x in metrics.read_text().splitlines()]
        step_time = statistics.median(m["step_time_s"] for m in steps)
        ckpts = sorted(p.name for p in out.glob("checkpoint-*"))
        code75 = "code 75" in stdout
    saved = seen["saved"] - t0 if "saved" in seen else float("nan")
    print(f"SIGTERM -> checkpoint written: {saved:.2f} s; -> torchrun exit: {dt:.2f} s "
          f"(a step takes {step_time:.2f} s; checkpoints: {ckpts}; "
          f"workers reported exit code 75: {code75}; torchrun exit code {p.returncode})")


def bench_blocking(model: str, repeats: int) -> None:
    """How long a save holds up training, synchronous (async_save=false) against background (async_save), paired in
    one process: each round a synchronous save, then a background save followed by one training step while it is
    written, then the wait for it. model: 'tiny' (the ~21M model above) or an HF directory (one process, full
    format: its weights and AdamW state)."""
    import torch
    torch.set_num_threads(1)
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    over = [MODEL] if model == "tiny" else [f"model.name_or_path={model}", "model.tiny=null"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, TRAIN + over + [f"output_dir={tmp}", "save_format=full", "save_total_limit=2"])
        tr = GRPOTrainer(cfg, init_distributed(600))
        tr.train_step()
        rows = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tr.save()
            sync = time.perf_counter() - t0
            tr.checkpointer.save_times(wait=True)
            t0 = time.perf_counter()
            tr.save(background=True)
            blocking = time.perf_counter() - t0
            tr.train_step()  # trains while the checkpoint is written
            total = tr.checkpointer.save_times(wait=True)["time_save_s"]
            rows.append((sync, blocking, total))
        n = sum(p.numel() for p in tr.gen_model.parameters())
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    print(f"{model}: {n / 1e6:.1f}M parameters, full save, one process; median of {repeats} paired rounds: "
          f"synchronous save blocks {med[0]:.3f} s; background save blocks {med[1]:.3f} s (its own time "
          f"{med[2]:.3f} s, one training step written over); rounds (sync, blocking, total): "
          + ", ".join(f"({a:.3f}, {b:.3f}, {c:.3f})" for a, b, c in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-sigterm", action="store_true")
    ap.add_argument("--blocking", metavar="MODEL", help="only the blocking time of a save, synchronous against "
                    "async_save: 'tiny' or an HF model directory")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    if args.blocking:
        bench_blocking(args.blocking, args.repeats)
        return
    bench_save_load(args.repeats)
    if not args.skip_sigterm:
        bench_sigterm()


if __name__ == "__main__":
    main()

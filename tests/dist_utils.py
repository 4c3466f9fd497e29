"""Run a function on N gloo ranks in fresh processes (torch.multiprocessing spawn) and collect results."""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, out_dir, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        # Free what fn left in reference cycles (a trainer kept alive by a caught exception's traceback) while the
        # interpreter is whole. Left to the interpreter's exit, that teardown sometimes aborted a rank after its
        # result was written ("terminate called without an active exception", SIGABRT: a C++ thread meeting a
        # finalizing interpreter): once in CI and in 2 of ~50 local runs of the NaN test in test_fault_tolerance.py.
        result = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's teardown, which has nothing left to do for the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, tmp_path, *args, timeout: float = 300):
    """fn(rank, world_size, *args) on every rank; returns the list of results (raises with the first traceback)."""
    out_dir = str(tmp_path / f"ranks_{fn.__name__}_{world_size}_{free_port()}")
    os.makedirs(out_dir)
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
                             join=False, start_method="spawn")
    import time
    deadline = time.time() + timeout
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout} s (deadlock?)")
    results = []
    for r in range(world_size):
        res = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
        if not res["ok"]:
            raise AssertionError(f"rank {r} failed:\n{res['error']}")
        results.append(res["result"])
    return results

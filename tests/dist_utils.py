"""Run a function on N gloo ranks in fresh processes and collect results.

The ranks start from a fork server (multiprocessing's forkserver) that has imported torch, transformers and the
trainer once, on the first call: each later call starts its ranks in well under a second instead of importing them
again in every rank (measured at load average ~19 on 2 cores: 2.7 s per 2-rank call against 31-39 s with spawn; the
suite makes ~116 such calls). A rank is still a fresh child of that clean server, never of pytest, and gets the
caller's environment, working directory and sys.path as spawn gave them (_entry). What it cannot get is an
environment variable read at import by a preloaded module; GRPO_DIST_TEST_START_METHOD=spawn goes back to spawn.
"""

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


START_METHOD = os.environ.get("GRPO_DIST_TEST_START_METHOD", "forkserver")
# what every rank imports anyway; nothing here reads the environment at import (grpo_dist reads it at call time)
PRELOAD = ["torch", "torch.distributed", "transformers", "safetensors.torch", "grpo_dist.trainer"]


def _attach_stdio(out, err) -> None:
    """In a rank: its stdout and stderr become the caller's (a fork server's are those of the test that started
    it, e.g. a capfd capture long closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, dup in ((1, out), (2, err)):
        new = dup.detach()
        os.dup2(new, fd)
        os.close(new)


class _CallerStdio:
    """Pickled into a rank's arguments: the caller's fds 1 and 2, passed to the child as it starts (DupFd works
    only while multiprocessing pickles a process to start), attached as the child unpickles its arguments."""

    def __reduce__(self):
        from multiprocessing import reduction
        return (_attach_stdio, (reduction.DupFd(1), reduction.DupFd(2)))


def _entry(rank, fn, world_size, port, out_dir, args, caller=None):
    if caller is not None:  # the caller's process state, which a fork server started earlier does not have
        env, cwd, path, _ = caller  # the last item did its work as it was unpickled (_CallerStdio)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
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
    if START_METHOD == "forkserver":
        import multiprocessing
        multiprocessing.set_forkserver_preload(PRELOAD)  # used when the server starts (the first call)
    caller = (dict(os.environ), os.getcwd(), list(sys.path), _CallerStdio() if START_METHOD == "forkserver" else None)
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args, caller), nprocs=world_size,
                             join=False, start_method=START_METHOD)
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

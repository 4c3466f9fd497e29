"""Process group setup and the few collectives the trainer uses.

Every collective of the trainer goes through this module or the engine, so it is easy to check that every rank
runs the same ones in the same order. Runs under torchrun (RANK/WORLD_SIZE/... from the environment) and as a plain
single process (a world of one). nccl on CUDA (gloo where GRPO_DIST_SHARE_GPU=1 puts several ranks on one GPU:
cuda_device), gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = 600, num_threads: int | None = None) -> DistContext:
    """Join (or create) the process group. Idempotent: returns the existing context when already initialised."""
    if "RANK" not in os.environ:  # a plain `python -m grpo_dist.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device, backend = cuda_device(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                      torch.cuda.device_count(), os.environ.get(SHARE_GPU_ENV) == "1")
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # Several ranks share the cores of one host: oversubscribed threads make generation 10-20x slower.
        threads = num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or (1 if world > 1 else None)
        if threads:
            torch.set_num_threads(threads)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # device_id binds the NCCL communicator to this rank's GPU at once (no guess from the current device, no
        # lazy init at the first collective, which some torch versions warn may hang); gloo takes none.
        extra: dict = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=_elastic_attempt_store(world, timeout), **extra)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


SHARE_GPU_ENV = "GRPO_DIST_SHARE_GPU"


def cuda_device(local_rank: int, local_world: int, gpus: int, share: bool) -> tuple[torch.device, str]:
    """This rank's GPU and process-group backend: GPU LOCAL_RANK and nccl, one rank per GPU.

    More ranks on a node than visible GPUs (bench/gpu_check.sh's 1 trainer + 1 rollout rank on one GPU) is refused
    unless GRPO_DIST_SHARE_GPU=1: then rank r takes GPU r mod the GPU count and every process group runs gloo (CUDA
    tensors staged through host memory), because NCCL refuses two ranks of one communicator on one GPU ("Duplicate
    GPU detected", ncclInvalidUsage). The decision uses LOCAL_WORLD_SIZE, the same on every rank of the node, so
    all ranks agree on the backend."""
    if local_rank < gpus and local_world <= gpus:
        return torch.device("cuda", local_rank), "nccl"
    if not share:
        raise RuntimeError(f"LOCAL_RANK {local_rank} of {local_world} ranks on this node, {gpus} visible GPU(s): "
                           f"launch at most one rank per GPU (torchrun --nproc_per_node {gpus}), or set "
                           f"{SHARE_GPU_ENV}=1 to put several ranks on one GPU (gloo process groups, not nccl)")
    return torch.device("cuda", local_rank % gpus), "gloo"


def _elastic_attempt_store(world: int, timeout: datetime.timedelta):
    """A store private to this attempt of a `torchrun --max-restarts` job, or None (the default env:// store).

    torchrun's c10d rendezvous shares one TCP store across all attempts, and process groups write their addresses
    under the same keys every time; a restarted worker can then read a dead worker's address from the previous
    attempt and fail with "connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712, #167288).
    On one node every worker gets the same TORCHELASTIC_RESTART_COUNT, so it names the attempt. Across nodes the
    agents' counts can differ: there, launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store
    per attempt) instead."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        if attempt != "0" and int(os.environ["RANK"]) == 0:
            print("[grpo_dist] warning: restarted multi-node torchrun job on a shared rendezvous store; if process "
                  "group setup fails, launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", flush=True)
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"grpo_dist/attempt_{attempt}", store)


# The process group the trainer's collectives run in: None (the world), or the trainer ranks' own group under
# asynchronous GRPO (rollout_ranks > 0; grpo_dist/async_rollout.py), where the rollout ranks never join them.
_GROUP = None


def use_group(group) -> None:
    """Every collective of this module (and of the engines, through group()) runs in `group` from here on."""
    global _GROUP
    _GROUP = group


# A thread's own group (thread_group): the background checkpoint writer (async_save.py) runs its collectives in a
# gloo group of the same ranks, so that they never interleave with the training thread's in one group.
_THREAD = threading.local()


def group():
    return getattr(_THREAD, "group", _GROUP)


@contextmanager
def thread_group(g) -> Iterator[None]:
    """Every collective of this module that the calling thread runs inside the block runs in `g`."""
    _THREAD.group = g
    try:
        yield
    finally:
        del _THREAD.group


# The trainer ranks' gloo group for the background checkpoint writer, made with the trainer group where the trainers
# are a group of their own (async_rollout.setup: every world rank must join the making of a group).
_SAVE_GROUP = None


def use_save_group(g) -> None:
    global _SAVE_GROUP
    _SAVE_GROUP = g


def new_gloo_group_of_current(timeout_s: float):
    """A gloo group of the current group's ranks (None without a process group), whose collectives fail after
    timeout_s as the trainer's do: the one use_save_group set, else made now over the world (collective: where no
    trainer group is in use, the trainers are the world)."""
    if not dist.is_initialized():
        return None
    if _SAVE_GROUP is not None:
        return _SAVE_GROUP
    if group() is not None:  # a bug: the background writer would run its collectives in the training group
        raise RuntimeError("a trainer group is in use without a save group (distributed.use_save_group)")
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def group_size() -> int:
    """The number of ranks the trainer's collectives span (1 without a process group)."""
    return dist.get_world_size(group()) if dist.is_initialized() else 1


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float | torch.Tensor] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Element-wise sum over ranks of a float64 vector (one collective for many metrics)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device).clone()
    if group_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group())
    return t.cpu()


def all_reduce_sum_named(values: Mapping[str, float | torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """all_reduce_sum of named values: one float64 vector, one collective, laid out in sorted name order (every
    rank must pass the same names). Returns each sum by name as a 0-dim float64 tensor."""
    names = sorted(values)
    total = all_reduce_sum([values[k] for k in names], device)
    return dict(zip(names, total.unbind()))


def all_reduce_max(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64, device=device).clone()
    if group_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group())
    return t.cpu()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when the flag is true on at least one (e.g. a non-finite loss, a stop signal)."""
    return bool(all_reduce_max([1.0 if flag else 0.0], device)[0] > 0)


def barrier() -> None:
    if group_size() > 1:
        dist.barrier(group=group())


def broadcast_object(obj, src: int = 0):
    if group_size() <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group())  # src: a global rank
    return box[0]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """In place: every rank's tensors take rank `src`'s values (same list, same order, on the rank's device)."""
    if group_size() > 1:
        for t in tensors:
            dist.broadcast(t, src=src, group=group())


def broadcast_state(obj, device: torch.device, src: int = 0):
    """Rank src's nested dicts / lists of tensors and plain values (what the others pass is ignored) on every
    rank: the layout pickled once, then tensor by tensor on `device` (nccl needs CUDA tensors), each put back on
    the device it had on rank src. A full copy per rank: for the checkpoints of a trainer group that torch's
    broadcast_from_rank0 (the world group) cannot serve."""
    if group_size() <= 1:
        return obj
    tensors: list[torch.Tensor] = []

    def layout(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1, tuple(x.shape), x.dtype, x.device.type)
        if isinstance(x, dict):
            return {k: layout(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(layout(v) for v in x)
        return x

    here = dist.get_rank() == src
    skeleton = broadcast_object(layout(obj) if here else None, src)

    def fill(x):
        if isinstance(x, _Slot):
            t = tensors[x.at].to(device) if here else torch.empty(x.shape, dtype=x.dtype, device=device)
            dist.broadcast(t, src=src, group=group())
            return t.to(x.device)
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x
    return fill(skeleton)


class _Slot(NamedTuple):
    """broadcast_state's place of one tensor in the layout."""
    at: int
    shape: tuple
    dtype: torch.dtype
    device: str


def gather_object(obj, dst: int = 0) -> list | None:
    """The list of every rank's `obj` on rank `dst`, None elsewhere (pickled; for small metadata only)."""
    if group_size() <= 1:
        return [obj]
    out = [None] * group_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group())
    return out


def all_gather_1d(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every rank's 1-D tensor, in rank order; the lengths may differ (two collectives: sizes, then the data padded
    to the longest). t must be on `device` (the process group's: nccl needs CUDA tensors)."""
    if group_size() <= 1:
        return [t]
    world = group_size()
    sizes = torch.tensor([t.numel()], dtype=torch.long, device=device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group())
    n = [int(s) for s in all_sizes]
    padded = torch.zeros(max(max(n), 1), dtype=t.dtype, device=device)
    padded[:t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group())
    return [o[:k] for o, k in zip(out, n)]

"""Asynchronous GRPO (config keys rollout_ranks, max_staleness; docs/async.md): of the W ranks, the first
T = W - R train (their own process group: FSDP / FSDP2, every trainer collective of grpo_dist.distributed), the
last R only generate and grade. The trainers keep the data cursor (PromptSampler) and checkpoints; a rollout rank
keeps no state but the weights of the last version it received.

Process groups, created by every rank in this order (setup):
    trainer  ranks 0 .. T-1               FSDP and the trainer's all-reduces
    rollout  ranks T .. W-1               (nothing yet: room for vLLM tensor parallelism)
    sync     rank 0 and ranks T .. W-1    the weight push (the world's backend: nccl on CUDA, gloo on CPU
                                          and where GRPO_DIST_SHARE_GPU=1 puts ranks on one GPU); on a rollout
                                          rank only its WeightReceiver thread uses it
    control  all ranks, gloo              headers and prompts out, completions back (pickled, point to point,
                                          queued: a sender never blocks on its receiver)
Trainer t sends its prompts to rollout rank T + t mod R; a rollout rank serves its trainers in rank order.

The protocol, for steps s = 0 .. N-1 and staleness k (batch j is the prompts of step j; H = a header from
rank 0 to every rollout rank: the version batch j is sampled with; when the version is new rank 0 pushes it on
the sync group (push_version: the version, then the weights), which each rollout rank's WeightReceiver thread
takes into a second buffer while the rank samples, so the push never waits for the batch in hand; -1 stops):

    trainer t (rank 0 broadcasts)                        rollout rank T + t mod R
    -----------------------------                        ------------------------
    for j in 0 .. min(k, N-1):                            loop:
        [t = 0] H(version 0, weights once) ------------->     recv H; -1: stop; new version: swap in its weights
        send prompts of batch j ------------------------->     recv prompts of batch j (per served trainer)
    for s in 0 .. N-1:                                         sample_and_grade on its weights (graded.py)
        recv completions of batch s  <--------------------     send completions + version + behaviour log-probs
        drop them if s - version > k (counted)
        learn (one optimizer step): version s + 1
        if s + k + 1 < N:
            [t = 0] H(version s + 1, weights) ----------->
            send prompts of batch s + k + 1 -------------->
    [t = 0] H(-1) ------------------------------------->     stop

Batch j is sampled with version max(0, j - k) and trains at step j: the lag is min(j, k) <= k, and no prompt is
sampled only to be dropped. With dynamic_sampling a step may take more rounds: each extra round is the next batch
of the pipeline, and its replacement goes out at once on the same version (refill): at most k + 1 batches are ever
in flight and every step takes at least one, so a batch sampled with version v still trains by step v + k.
With k = 0 this is the colocated order exactly (sync, sample, grade, learn), and with
the per-prompt sampling noise (sampling_noise.py) a rollout rank draws what the trainer itself would have drawn:
the same weights and optimizer state, bitwise: serve runs graded.sample_and_grade, the function a colocated rank
runs, and reads nothing of the trainer (AsyncRollouts is given the sampler, the weights and the stop callback).
With LoRA the weights pushed are the adapters only, merged on the rollout rank (AdapterMerge).
Every blocking wait has distributed.timeout_s; a wait that fails
raises PeerLost, one line naming this rank, the peer and what was awaited.

Failures (docs/async.md): a rank that fails with an exception sends, best effort, an Abort in place of the next
message its listeners wait for (a trainer to its rollout rank, rank 0 to every rollout rank, since they all read
its headers; a rollout rank to the trainers it serves), and waits at most ABORT_WAIT_S for it to be taken (gloo
hands a message over only while its sender lives). A listener that reads an Abort raises PeerLost with the
failed rank's line at once, instead of waiting out distributed.timeout_s. A rank that dies closes its connections:
its peers' waits fail at once. One that stops (SIGSTOP) or hangs is given up on after distributed.timeout_s. A
slow one is waited for, up to distributed.timeout_s per message.

Resume (resume_from_checkpoint): the prompts go out from a copy of the trainer's PromptSampler running ahead; the
trainer's own cursor takes a batch only when its completions come back, so a checkpoint at step C holds the cursor
of batches 0 .. C-1 and nothing about what was in flight. The resumed job starts the diagram at s = C: batches
C .. C+k go out again, all sampled with version C (the checkpoint's weights; the versions C-k .. C-1 that sampled
some of them before are in no checkpoint), then as above. The rollout ranks keep nothing across the restart.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import pickle
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from grpo_dist import distributed as gdist
from grpo_dist import watchdog
from grpo_dist.config import ConfigError
from grpo_dist.graded import Graded, sample_and_grade
from grpo_dist.interrupts import PREEMPTED_EXIT_CODE, GracefulStop
from grpo_dist.rollout_engines import RolloutEngine

STOP = -1
ABORT_WAIT_S = 10.0  # how long a failing rank waits for its Abort to be taken (best effort: it is failing anyway)


class PeerLost(RuntimeError):
    """A wait on another rank ran past distributed.timeout_s, the peer went away or it sent an Abort (the message
    names both). peer: the rank waited for."""

    def __init__(self, line: str, peer: int | None = None):
        super().__init__(line)
        self.peer = peer


@dataclass(frozen=True)
class Abort:
    """Sent in place of the message a peer waits for: the sender failed (line: its rank, side and error)."""
    line: str


@dataclass
class Roles:
    """This rank's part in an asynchronous run, and the process groups of the module docstring."""
    trainers: int           # T
    rollouts: int           # R
    rank: int               # global
    timeout_s: float
    trainer_group: Any
    rollout_group: Any
    sync_group: Any
    control_group: Any
    device: torch.device

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainers

    def rollout_of(self, trainer: int) -> int:
        return self.trainers + trainer % self.rollouts

    def served(self) -> list[int]:
        """The trainer ranks this rollout rank samples for (none where R > T)."""
        return [t for t in range(self.trainers) if self.rollout_of(t) == self.rank]


_ROLES: Roles | None = None


def setup(cfg, ctx: gdist.DistContext) -> tuple[Roles, gdist.DistContext]:
    """Create the groups (a collective of every rank) and point grpo_dist.distributed at the trainer group.
    Returns the roles and the context the trainer is built with (its world: the trainer ranks)."""
    global _ROLES
    problems = cfg.async_problems(ctx.world_size)
    if problems:
        raise ConfigError(problems[0], problems)
    W, R = ctx.world_size, cfg.rollout_ranks
    T = W - R
    timeout = datetime.timedelta(seconds=cfg.distributed.timeout_s)
    trainer = dist.new_group(list(range(T)), timeout=timeout)
    rollout = dist.new_group(list(range(T, W)), timeout=timeout)
    sync = dist.new_group([0, *range(T, W)], timeout=timeout)  # the world's backend (distributed.cuda_device)
    control = dist.new_group(list(range(W)), timeout=timeout, backend="gloo")  # small pickled messages
    _ROLES = Roles(T, R, ctx.rank, float(cfg.distributed.timeout_s), trainer, rollout, sync, control, ctx.device)
    saves = dist.new_group(list(range(T)), timeout=timeout, backend="gloo")  # the background checkpoint writer's
    if _ROLES.is_trainer:
        gdist.use_group(trainer)
        gdist.use_save_group(saves)
    return _ROLES, replace(ctx, world_size=T if _ROLES.is_trainer else R)


def roles() -> Roles:
    if _ROLES is None:
        raise RuntimeError("async_rollout.setup() must run before an asynchronous trainer is built")
    return _ROLES


# ------------------------------------------------------------------------------------------------- transport
def _wait(work, roles_: Roles, what: str, peer: int, timeout_s: float | None = None) -> None:
    timeout_s = roles_.timeout_s if timeout_s is None else timeout_s
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerLost(_lost_line(roles_, what, peer, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"),
                       peer) from None
    if ok is False:
        raise PeerLost(_lost_line(roles_, what, peer, "timed out"), peer)


def _lost_line(roles_: Roles, what: str, peer: int, why: str) -> str:
    side = "trainer" if roles_.is_trainer else "rollout"
    peer_side = "trainer" if peer < roles_.trainers else "rollout"
    return (f"rank {roles_.rank} ({side}) waited up to {roles_.timeout_s:g} s (distributed.timeout_s) for {what} "
            f"from rank {peer} ({peer_side}) and stopped: {why}")


_OUTBOX: list[tuple] = []  # sends not yet taken: (work, buffer, what, peer); the buffers must live until then


def send_obj(obj, dst: int, roles_: Roles, what: str) -> None:
    """Queue a pickled message to rank dst and go on: a send that waited for its receiver could deadlock against
    the weight broadcast (the receiver busy generating, the sender blocked). flush() waits for what is queued."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    for t in (size, data):
        _OUTBOX.append((dist.isend(t, dst, group=roles_.control_group), t, what, dst))
    _OUTBOX[:] = [item for item in _OUTBOX if not item[0].is_completed()]


def flush(roles_: Roles) -> None:
    """Wait (up to the timeout each) until every queued message was taken."""
    while _OUTBOX:
        work, _, what, dst = _OUTBOX.pop(0)
        _wait(work, roles_, f"{what} to be taken", dst)


def recv_obj(src: int, roles_: Roles, what: str):
    """The next message from rank src; an Abort from it raises PeerLost with its line."""
    size = torch.zeros(1, dtype=torch.long)
    _wait(dist.irecv(size, src, group=roles_.control_group), roles_, what, src)
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    _wait(dist.irecv(data, src, group=roles_.control_group), roles_, what, src)
    obj = pickle.loads(data.numpy().tobytes())
    if isinstance(obj, Abort):
        side = "trainer" if roles_.is_trainer else "rollout"
        raise PeerLost(f"rank {roles_.rank} ({side}) stopped waiting for {what}: {obj.line}", src)
    return obj


def tell_failure(roles_: Roles, error: BaseException, listeners: list[int]) -> None:
    """Best effort, on a failing rank's way out: an Abort to each listener (but the peer the error names: it is
    gone), waiting at most ABORT_WAIT_S in all for them to be taken. Never raises."""
    line = f"rank {roles_.rank} ({'trainer' if roles_.is_trainer else 'rollout'}) failed: {type(error).__name__}: " \
           f"{(str(error).splitlines() or [''])[0][:300]}"
    lost = getattr(error, "peer", None)
    _OUTBOX[:] = [item for item in _OUTBOX if item[3] != lost]  # queued to the lost peer: never taken
    for dst in listeners:
        if dst != lost:
            try:
                send_obj(Abort(line), dst, roles_, "the abort message")
            except RuntimeError:  # its connection is closed already
                pass
    deadline = time.monotonic() + min(ABORT_WAIT_S, roles_.timeout_s)
    while _OUTBOX:
        work, _, what, dst = _OUTBOX.pop(0)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            _wait(work, roles_, what, dst, left)
        except PeerLost:
            pass
    _OUTBOX.clear()


def _broadcast(t: torch.Tensor, roles_: Roles, what: str) -> None:
    """On the sync group from rank 0. A failed wait names the other side: rank 0 for a rollout rank, the (first)
    rollout rank for trainer rank 0 (gloo does not say which receiver of a broadcast is missing)."""
    work = dist.broadcast(t, src=0, group=roles_.sync_group, async_op=True)
    _wait(work, roles_, what, roles_.trainers if roles_.is_trainer else 0)


# --------------------------------------------------------------------------------------------- trainer side
class AsyncRollouts:
    """The trainer's end: sends prompt batches and weights, receives graded completions (module docstring). It
    reads nothing of the trainer: the data sampler, the policy's weights and the stop request are passed in."""

    def __init__(self, cfg, ctx: gdist.DistContext, sampler, weights, request_stop):
        """sampler: the trainer's PromptSampler (its cursor advances as batches come back); weights(dtype): an
        iterator of the policy's full weights (Engine.iter_full_weights, a collective of the trainer ranks);
        request_stop(): called when this rank's rollout rank was asked to stop."""
        self.cfg, self.ctx, self.roles = cfg, ctx, roles()
        self.sampler, self.weights, self.request_stop = sampler, weights, request_stop
        self.k = cfg.max_staleness
        self.version = 0          # the trainer's policy version: optimizer steps taken
        self.sent_version: int | None = None  # the last version broadcast (every trainer tracks it)
        self.manifest: list[tuple[str, tuple, torch.dtype]] | None = None
        self.next_batch = 0       # the batch whose prompts go out next (one per round: without dynamic sampling
        self.received = 0         # the batch number is the step's); batches whose completions came back
        self.ahead: Any = None    # the PromptSampler the prompts go out from (start)
        self.in_flight: dict[int, tuple[int, list[int]]] = {}  # batch -> (global batch number, its examples)
        self.stats: dict[str, Any] = dict(lags=[], dropped=0, sync_s=0.0, sync_bytes=0, wait_s=0.0,
                                          rollout_idle=0.0, rollout_busy=0.0)
        self.started = self.closed = False
        self.peer_stopping = False  # this rank's rollout rank asked for a stop (SIGTERM there)

    @property
    def peer(self) -> int:
        return self.roles.rollout_of(self.ctx.rank)

    def start(self, step: int) -> None:
        """The first k + 1 batches, all sampled with the loaded policy (version 0, or the checkpoint's step after
        a resume: the batches in flight when the job died are regenerated with the resumed weights)."""
        self.version = step
        self.next_batch = self.received = step
        # Two cursors over one prompt order: the prompts go out from a copy that runs up to k + 1 batches ahead;
        # the trainer's sampler advances only when a batch's completions come back (receive), so a checkpoint's
        # cursor is that of the batches trained and a resume regenerates the ones in flight, neither lost nor
        # repeated.
        self.ahead = copy.copy(self.sampler)
        self.started = True
        while self._wanted(step):
            self._send_batch()

    def after_step(self, step: int) -> None:
        """After the optimizer step of step s (step = s + 1 steps taken): version s + 1, and the prompts of the next
        batch when one is still needed."""
        self.version = step
        if self._wanted(step):
            self._send_batch()

    def refill(self, step: int) -> None:
        """Dynamic sampling takes one more round in step `step`: a batch goes out on the same weights first (at
        max_staleness 0 nothing else is in flight)."""
        if self._wanted(step):
            self._send_batch()

    def _wanted(self, step: int) -> bool:
        """Whether another batch goes out now: at most k + 1 in flight (so a batch sampled with version v trains by
        step v + k: every step takes at least one), and no more than the max_steps - step steps left need."""
        return self.next_batch - self.received < min(self.k + 1, self.cfg.max_steps - step)

    def _send_batch(self) -> None:
        from grpo_dist import faults
        self._sync_weights(self.version)
        examples = self.ahead.next_batch()  # the data cursor stays with the trainers
        message = dict(batch=self.next_batch, batch_number=self.ahead.last_batch_number,
                       indices=list(self.ahead.last_prompt_indices), examples=examples)
        self.in_flight[self.next_batch] = (message["batch_number"], list(self.ahead.last_global_indices))
        send_obj(message, self.peer, self.roles, f"the prompts of batch {self.next_batch}")
        self.next_batch += 1
        if faults.due("kill_sent", self.next_batch, self.ctx.rank):  # tests: taken, then in flight when it dies
            flush(self.roles)
            faults.inject("kill_sent", self.next_batch, self.ctx.rank)

    def _sync_weights(self, version: int) -> None:
        """Header (version) on the sync group, then the weights when they are new. Every trainer rank runs
        weights() (a collective of the trainer group under FSDP); rank 0 broadcasts."""
        from grpo_dist.rollout_engines import rollout_dtype
        main = self.ctx.rank == 0
        t0 = time.perf_counter()
        new = version != self.sent_version
        if new and self.manifest is None:  # once: names, shapes and dtypes, so the rollout ranks can receive
            self.manifest = [(n, tuple(t.shape), t.dtype) for n, t in self.weights(rollout_dtype(self.cfg))]
            if main:
                for dst in range(self.roles.trainers, self.roles.trainers + self.roles.rollouts):
                    send_obj(self.manifest, dst, self.roles, "the weight manifest")
        if main:
            self._header(version)
        if new:
            self.stats["sync_bytes"] += push_version(version, (t for _, t in self.weights(rollout_dtype(self.cfg))),
                                                     self.roles)
            self.sent_version = version
        self.stats["sync_s"] += time.perf_counter() - t0

    def receive(self, step: int) -> Graded:
        """The next graded batch, for step `step`, sampled and graded on the rollout rank; one older than
        max_staleness is dropped (counted) and this rank trains no row of it."""
        batch_id = self.received
        t0 = time.perf_counter()
        msg = recv_obj(self.peer, self.roles, f"the completions of batch {batch_id}")
        self.stats["wait_s"] += time.perf_counter() - t0
        self.received += 1
        if msg["batch"] != batch_id:
            raise RuntimeError(f"rank {self.ctx.rank}: expected the completions of batch {batch_id}, got batch "
                               f"{msg['batch']} (protocol out of order)")
        self._advance_cursor(batch_id, step)
        if msg.get("stop_requested") and not self.peer_stopping:  # the rollout rank was asked to stop
            self.peer_stopping = True
            print(f"[grpo_dist] rank {self.ctx.rank} (trainer): rank {self.peer} (rollout) was asked to stop: "
                  f"finishing step {step + 1}, then writing a checkpoint and exiting with code 75", flush=True)
            self.request_stop()
        self.stats["rollout_idle"], self.stats["rollout_busy"] = msg["idle_s"], msg["busy_s"]
        graded: Graded = msg["graded"]
        lag = step - msg["version"]
        self.stats["lags"].append(lag)
        if not accepted(lag, self.k):
            self.stats["dropped"] += len(graded.rewards)
            graded = Graded(graded.batch.rows([]), [], {name: [] for name in graded.per_function}, graded.errors,
                            graded.decode)
        return graded

    def _advance_cursor(self, batch_id: int, step: int) -> None:
        """Batch `batch_id` trains: the trainer's own cursor takes it (what a checkpoint saves), and must name the
        prompts that went out with it."""
        from grpo_dist.trained_prompts import record
        self.sampler.next_batch()
        sent = self.in_flight.pop(batch_id)
        if sent != (self.sampler.last_batch_number, list(self.sampler.last_global_indices)):
            raise RuntimeError(f"rank {self.ctx.rank}: batch {batch_id} went out as global batch {sent[0]}, the "
                               f"trainer's cursor is at {self.sampler.last_batch_number} (cursors out of step)")
        record(step + 1, self.ctx.rank, self.sampler)

    def metrics(self, step_time_s: float) -> dict:
        """async/* of this step over the trainer ranks (two all-reduces, every trainer rank)."""
        s, dev = self.stats, self.ctx.device
        lags = s["lags"]
        total = gdist.all_reduce_sum([float(sum(lags)), float(len(lags)), float(s["dropped"]),
                                      s["wait_s"], step_time_s], dev)
        mx = gdist.all_reduce_max([float(max(lags, default=0))], dev)
        busy = s["rollout_idle"] + s["rollout_busy"]
        out = {"async/lag_mean": float(total[0] / max(float(total[1]), 1.0)), "async/lag_max": float(mx[0]),
               "async/dropped": float(total[2]), "async/weight_sync_s": s["sync_s"],
               "async/weight_sync_bytes": float(s["sync_bytes"]),
               "async/trainer_idle_fraction": float(total[3] / max(float(total[4]), 1e-9)),
               "async/rollout_idle_fraction": s["rollout_idle"] / busy if busy else 0.0}
        self.stats.update(lags=[], dropped=0, sync_s=0.0, sync_bytes=0, wait_s=0.0)
        return out

    def abort(self, error: BaseException) -> None:
        """The trainer's failure path: tell the rollout ranks that read this rank's messages (rank 0: all of them,
        for its headers; another trainer: its own) that it failed, so they stop now and name the failure."""
        if self.closed:
            return
        self.closed = True
        everyone = list(range(self.roles.trainers, self.roles.trainers + self.roles.rollouts))
        tell_failure(self.roles, error, everyone if self.ctx.rank == 0 else [self.peer])

    def close(self) -> None:
        """Take what is still in flight (a run that stopped early), then stop the rollout ranks."""
        if self.closed or not self.started:
            return
        self.closed = True
        while self.received < self.next_batch:  # a stop before max_steps: k batches may be in flight
            recv_obj(self.peer, self.roles, "completions still in flight at the end")
            self.received += 1
        if self.ctx.rank == 0:
            self._header(STOP)
            if self.sent_version is not None:  # the rollout ranks' weight receivers end too
                push_version(STOP, iter(()), self.roles)
        flush(self.roles)

    def _header(self, version: int) -> None:
        """To every rollout rank, ahead of each batch: the version to sample it with (STOP: the end)."""
        for dst in range(self.roles.trainers, self.roles.trainers + self.roles.rollouts):
            send_obj(version, dst, self.roles, f"the version header {version}")


def push_version(version: int, tensors, roles_: Roles) -> int:
    """A weight push, the trainers' end of WeightReceiver: the version, then the tensors in manifest order,
    broadcast from rank 0 on the sync group (STOP and no tensors: the receivers end). Every trainer rank consumes
    `tensors` (a collective of the trainer group under FSDP); rank 0 sends. Returns the weight bytes sent. The
    rollout ranks take it while they sample, so it waits only for the transfer (and, one version staged at most,
    for a rollout rank still sampling with a version two pushes back)."""
    main, nbytes = roles_.rank == 0, 0
    if main:
        _broadcast(torch.tensor([version], device=roles_.device), roles_, "the pushed version")
    for t in tensors:
        if main:
            t = t.contiguous()
            _broadcast(t, roles_, "the weight broadcast")
            nbytes += t.numel() * t.element_size()
    return nbytes


def accepted(lag: int, max_staleness: int) -> bool:
    """A completion sampled `lag` optimizer steps ago trains only within the staleness bound."""
    return 0 <= lag <= max_staleness


# --------------------------------------------------------------------------------------------- rollout side
def replica_engine(cfg, ctx: gdist.DistContext, tokenizer):
    """(rollout engine, EOS ids, LoRA merger or None) on a plain replica of the configured model, in the compute
    dtype: what a rollout rank samples with, and what a trainer rank evaluates with when rollout_ranks > 0 (it
    builds no replica for sampling). Its weights are the policy's once synced. With LoRA the merger turns pushed
    adapters into the merged weights (AdapterMerge). With rollout_engine=vllm this rank owns a vLLM engine, in a
    process of its own (VLLMRolloutEngine own_process: the other ranks build none), and no replica."""
    from grpo_dist.decoder import prepare_replica
    from grpo_dist.models import MIXED_PRECISION_DTYPES, copy_in_dtype, load_model
    from grpo_dist.rollout import eos_token_ids
    from grpo_dist.rollout_engines import build_rollout_engine, tied_aliases

    policy = load_model(cfg.model, tokenizer)
    if cfg.rollout_engine == "vllm":  # its own copy of the weights, loaded by the first sync (dummy until then)
        engine = build_rollout_engine(cfg, ctx, None, tokenizer, tied_aliases(policy),
                                      num_params=sum(p.numel() for p in policy.parameters()), synced=True,
                                      own_process=True)
        return engine, tuple(eos_token_ids(policy, tokenizer)), AdapterMerge(cfg, policy) if cfg.lora.r else None
    replica = copy_in_dtype(policy, MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision)).eval()
    replica.to(ctx.device).requires_grad_(False)
    eos = tuple(eos_token_ids(policy, tokenizer))
    tied = tied_aliases(policy)
    merge = AdapterMerge(cfg, policy) if cfg.lora.r else None
    if merge is not None:  # an adapted tied head gets a merged weight of its own, as on a colocated replica
        from grpo_dist import lora
        lora.untie(replica, lora.adapted_tied_weights(policy))
    del policy
    prepare_replica(replica)
    return build_rollout_engine(cfg, ctx, replica, tokenizer, tied, synced=True), eos, merge


class AdapterMerge:
    """LoRA with rollout ranks: the trainers push the adapters only (r x (d_in + d_out) per adapted layer, not the
    model), and the rollout rank merges them into its own copy of the frozen base weights with the function the
    trainer's engines merge with (lora.merged), so the replica gets the weights a colocated sync gives, bitwise."""

    def __init__(self, cfg, policy):
        from grpo_dist import lora
        from grpo_dist.engines import clean_name
        from grpo_dist.rollout_engines import rollout_dtype
        lora.apply_lora(policy, cfg.lora, cfg.model.init_seed)  # the adapted model's names (base_layer, lora_A/B)
        self.named = {clean_name(n): p.detach() for n, p in policy.named_parameters(remove_duplicate=False)}
        self.scaling, self.dtype = lora.scaling(cfg.lora), rollout_dtype(cfg)

    def __call__(self, adapters):
        """The merged weights (plain names, in the rollout dtype) from an iterator of pushed adapter tensors."""
        from grpo_dist.lora import merged
        self.named.update(dict(adapters))
        for name, t in merged(self.named, self.scaling).items():
            yield name, t if self.dtype is None else t.to(self.dtype)


def _rollout_side(cfg, ctx: gdist.DistContext):
    """(tokenizer, rollout engine, reward functions, EOS ids, LoRA merger) of a rollout rank."""
    from grpo_dist.models import load_tokenizer, reward_dtype
    from grpo_dist.rewards import RewardComputer

    tokenizer = load_tokenizer(cfg.model)
    engine, eos, merge = replica_engine(cfg, ctx, tokenizer)
    rewards = RewardComputer(cfg.rewards, num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,
                             device=ctx.device, dtype=reward_dtype(cfg), conversational=cfg.data.use_chat_template)
    return tokenizer, engine, rewards, eos, merge


def serve(cfg, roles_: Roles, ctx: gdist.DistContext) -> int:
    """A rollout rank's whole life: build the replica, the engine and the reward functions, then answer batches
    until the stop header. Returns the exit code."""
    from grpo_dist import faults

    tokenizer, engine, rewards, eos, merge = _rollout_side(cfg, ctx)
    served = roles_.served()
    manifest = recv_obj(0, roles_, "the weight manifest")
    receiver = WeightReceiver(manifest, roles_)
    version: int | None = None
    idle, busy, j = 0.0, 0.0, 0
    stop = _RolloutStop(roles_.rank)

    try:
        with GracefulStop(stop.request, False, lambda: j).installed():
            while True:
                t0 = time.perf_counter()
                watchdog.set_phase("rollout-wait", j)
                header = recv_obj(0, roles_, f"the version header of batch {j}")
                if header == STOP:
                    receiver.join()
                    flush(roles_)
                    return PREEMPTED_EXIT_CODE if stop.requested else 0
                if header != version:  # a new version: switch weights between generation batches
                    watchdog.set_phase("weight-sync", j)
                    weights = receiver.take(header)  # received while the last batch was sampled
                    engine.sync_weights(merge(weights) if merge is not None else weights)
                    receiver.release()
                    version = header
                for t in served:
                    msg = recv_obj(t, roles_, f"the prompts of batch {j}")
                    idle += time.perf_counter() - t0
                    # that trainer stops after the step it is on: it only drains what is in flight (with dynamic
                    # sampling that step may still take rounds: they are answered in full)
                    if t in stop.told and not cfg.dynamic_sampling:
                        send_obj(dict(batch=msg["batch"], drained=True), t, roles_,
                                 f"the drained batch {msg['batch']}")
                        t0 = time.perf_counter()
                        continue
                    t1 = time.perf_counter()
                    watchdog.set_phase("rollout", msg["batch"])
                    for fault in ("kill", "stop", "term"):  # a rollout rank that dies, hangs, is asked to stop (tests)
                        faults.inject(fault, msg["batch"] + 1, roles_.rank)
                    # the code a colocated rank runs, on the weights of `version`
                    graded = sample_and_grade(cfg, engine, tokenizer, rewards, msg["examples"],
                                              batch_number=msg["batch_number"], prompt_indices=msg["indices"],
                                              eos_ids=eos, device=ctx.device,
                                              stage=functools.partial(_phase, at=msg["batch"]))
                    graded.batch = graded.batch.to("cpu")
                    faults.slow_down(msg["batch"] + 1, roles_.rank, time.perf_counter() - t1)  # a slow rank (tests)
                    busy += time.perf_counter() - t1
                    send_obj(dict(batch=msg["batch"], version=version, graded=graded, idle_s=idle, busy_s=busy,
                                  stop_requested=stop.requested), t, roles_,
                             f"the completions of batch {msg['batch']}")
                    if stop.requested:
                        stop.told.add(t)
                    t0 = time.perf_counter()
                j += 1
    except PeerLost:
        raise
    except BaseException as e:  # this rank's own failure: its trainers stop now, naming it
        tell_failure(roles_, e, served)
        raise
    finally:
        rewards.close()
        engine.close()


def _phase(name: str, at: int):
    """sample_and_grade's stages on a rollout rank: what a trainer names if this rank stops or hangs in one."""
    watchdog.set_phase(name, at)
    return contextlib.nullcontext()


class _RolloutStop:
    """A stop request (SIGTERM, SIGUSR1, a first Ctrl-C) on a rollout rank. The rollout rank keeps no state, so it
    does not stop on its own: it finishes the batch in hand, sends it with stop_requested, and each trainer that
    reads the flag requests a stop (the trainers agree on it, checkpoint after the step, exit 75). Batches asked
    for after that are only drained by the trainers' close(): they get an empty answer at once. The rank exits 75
    at the trainers' stop header."""

    def __init__(self, rank: int):
        self.rank = rank
        self.requested = False
        self.told: set[int] = set()  # trainers sent a batch with stop_requested

    def request(self) -> None:
        if not self.requested:
            self.requested = True
            try:  # a signal handler: os.write, never print
                os.write(2, f"[grpo_dist] rank {self.rank} (rollout): stop requested: finishing the batch in hand; "
                            f"the trainers checkpoint after their step and exit with code {PREEMPTED_EXIT_CODE}\n"
                            .encode())
            except OSError:
                pass


class RolloutsElsewhere(RolloutEngine):
    """A trainer rank's rollout engine with rollout_ranks > 0: the rollout ranks sample, so this rank builds no
    generation replica (its memory stays with training) and nothing may ask it to generate."""
    name = "rollout ranks"

    def generate(self, prompt_ids, sampling):
        raise RuntimeError("with rollout_ranks > 0 a trainer rank does not generate: its rollouts come from the "
                           "rollout ranks (async_rollout.py)")

    def sync_weights(self, weights) -> None:
        raise RuntimeError("with rollout_ranks > 0 the weights go to the rollout ranks (AsyncRollouts), not to a "
                           "local engine")


class WeightReceiver:
    """A rollout rank's second weight buffer: a thread takes each pushed version (the version, then the weights of
    the manifest, broadcast by trainer rank 0 on the sync group) into fresh buffers while the main thread samples
    with the previous one, so trainer rank 0's push completes without waiting for the batch in hand to finish. The
    main thread swaps a version in between batches (take, engine.sync_weights, release). One version is staged at
    most: the thread receives the next only after release, so the memory held is the engine's weights plus one
    version (the model in the rollout dtype, or the adapters with LoRA), and a trainer pushing two versions ahead
    of the batch in hand waits as before. Only this thread touches the sync group on a rollout rank, so the
    broadcasts keep the order trainer rank 0 gives them. Its failures (PeerLost) reach the main thread at take."""

    def __init__(self, manifest, roles_: Roles):
        import threading
        self.manifest, self.roles = manifest, roles_
        self.cond = threading.Condition()
        self.staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="grpo_dist-weights", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        device = self.roles.device
        side = torch.cuda.Stream(device) if device.type == "cuda" else None  # off the sampling stream
        try:
            if side is not None:
                torch.cuda.set_device(device)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                while True:
                    with self.cond:  # one version staged at most: wait for the main thread's release
                        self.cond.wait_for(lambda: self.staged is None)
                    version = torch.zeros(1, dtype=torch.long, device=device)
                    _broadcast(version, self.roles, "the pushed version")
                    if int(version[0]) == STOP:
                        return
                    weights = []
                    for name, shape, dtype in self.manifest:
                        t = torch.empty(shape, dtype=dtype, device=device)
                        _broadcast(t, self.roles, f"the weight {name}")
                        weights.append((name, t))
                    if side is not None:
                        side.synchronize()  # the main thread reads them on its own stream
                    with self.cond:
                        self.staged = (int(version[0]), weights)
                        self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def take(self, version: int):
        """The staged weights of `version` (an iterator of (name, tensor)), waiting for them if still arriving;
        the receiver's own failure is raised here. Bounded: the receiver's waits have distributed.timeout_s."""
        with self.cond:
            while self.staged is None and self.error is None:
                if not self.cond.wait(timeout=1.0) and not self.thread.is_alive():
                    raise RuntimeError(f"rank {self.roles.rank}: the weight receiver ended before version {version}")
            if self.staged is None:
                assert self.error is not None
                raise self.error
            got, weights = self.staged
        if got != version:
            raise RuntimeError(f"rank {self.roles.rank}: expected the weights of version {version}, received "
                               f"version {got} (protocol out of order)")
        return iter(weights)

    def release(self) -> None:
        """The staged version is in the engine: its buffers go, and the next version may come in."""
        if self.roles.device.type == "cuda":  # the engine's copies ran on this thread's stream: done before reuse
            torch.cuda.current_stream(self.roles.device).synchronize()
        with self.cond:
            self.staged = None
            self.cond.notify_all()

    def join(self) -> None:
        """At the stop header: the receiver ends at trainer rank 0's stop broadcast."""
        self.thread.join(self.roles.timeout_s)
        if self.error is not None:
            raise self.error

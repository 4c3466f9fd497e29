"""Test-only fault injection, driven by one environment variable so that production code paths stay plain.

    GRPO_DIST_FAULT="KIND@stepN[@rankR],..."     e.g. "nan@step3@rank1" or "kill@step3@rank1,kill_save@step4@rank0"

KIND is one of
    nan         the loss of optimizer step N on rank R is NaN (and so are its gradients)
    nan_grad    the gradients of optimizer step N on rank R are NaN while its loss is finite
    stop        rank R SIGSTOPs itself in the middle of step N (where `kill` fires, after 0.5 s so that its
                heartbeat has published the phase): a hung rank, for the watchdog
    kill        rank R SIGKILLs itself in the middle of step N (after the backward, before the optimizer step)
    kill_save   rank R SIGKILLs itself while checkpoint-N is being written (files written, manifest not yet)
    kill_sent   trainer rank R SIGKILLs itself once its rollout rank took the prompts of step N (asynchronous GRPO:
                a kill with batches in flight)
    slow        from step N on, rollout rank R (rollout_ranks > 0) takes SLOW_FACTOR times as long over each batch
                (it sleeps SLOW_FACTOR - 1 times what generating and grading the batch took): a slow peer, which
                the run must wait for, not give up on
    term        rank R sends itself SIGTERM in the middle of step N (where `kill` fires; on a rollout rank, while
                it works on batch N - 1): a stop request that reaches one rank only, as a scheduler's may
    sigint      rank R sends SIGINT where a terminal's Ctrl-C goes, in the middle of step N (after the backward):
                to torchrun's process group under torchrun (its workers run in sessions of their own and get the
                signal from torchrun), else to its own process group; once per item, 0.3 s apart

Without `@rankR` the fault hits every rank. Faults fire only in the first attempt of an elastic job
(TORCHELASTIC_RESTART_COUNT unset or 0), so a job restarted by `torchrun --max-restarts` runs clean.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

ENV = "GRPO_DIST_FAULT"
KINDS = ("nan", "nan_grad", "kill", "kill_save", "kill_sent", "stop", "term", "sigint", "slow")
SLOW_FACTOR = 10
_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@step(?P<step>\d+)(?:@rank(?P<rank>\d+))?$")


def planned() -> list[tuple[str, int, int | None]]:
    text = os.environ.get(ENV, "").strip()
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    out = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m or m["kind"] not in KINDS:
            raise ValueError(f"{ENV}: cannot read {item!r}; expected KIND@stepN[@rankR] with KIND in {KINDS}")
        out.append((m["kind"], int(m["step"]), int(m["rank"]) if m["rank"] is not None else None))
    return out


def due(kind: str, step: int, rank: int) -> bool:
    """Whether inject(kind, step, rank) would fire (for what must happen before it, e.g. a send completing)."""
    return any(k == kind and s == step and r in (None, rank) for k, s, r in planned())


def inject(kind: str, step: int, rank: int) -> bool:
    """True when a `kind` fault is planned for this step and rank; the kill kinds do not return, `stop` returns
    when the process is continued (SIGCONT)."""
    for k, s, r in planned():
        if k == kind and s == step and r in (None, rank):
            if kind == "sigint":
                _ctrl_c()
                continue
            if kind == "term":
                print(f"[grpo_dist] {ENV}: rank {rank} sends itself SIGTERM (term at step {step})", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                continue
            if kind.startswith("kill"):
                print(f"[grpo_dist] {ENV}: rank {rank} kills itself ({kind} at step {step})", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "stop":
                print(f"[grpo_dist] {ENV}: rank {rank} stops itself (SIGSTOP at step {step})", file=sys.stderr,
                      flush=True)
                time.sleep(0.5)  # the heartbeat publishes this phase first (at most 4 beats a second, watchdog.py)
                os.kill(os.getpid(), signal.SIGSTOP)
            return True
    return False


def slow_down(step: int, rank: int, busy_s: float) -> bool:
    """`slow`: where planned for this rank from `step` on or earlier, sleep (SLOW_FACTOR - 1) x busy_s, the time the
    work just done took, so that it took SLOW_FACTOR times as long. True when it slept."""
    if any(k == "slow" and s <= step and r in (None, rank) for k, s, r in planned()):
        time.sleep((SLOW_FACTOR - 1) * busy_s)
        return True
    return False


def _ctrl_c() -> None:
    import time
    group = os.getpgid(os.getppid()) if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpgrp()
    os.killpg(group, signal.SIGINT)
    time.sleep(0.3)  # the handler runs (and torchrun forwards the signal) before another one is sent

"""`torchrun --nproc_per_node N -m grpo_dist.train --config configs/X.yaml [key=value ...]`

Also runs as a plain single process (`python -m grpo_dist.train ...`). Exit codes:
  0   done
  2   bad config or data (a reward function that fails on every completion of a step included), or a checkpoint
      that cannot be used or written (missing, damaged, of another model or kind, every checkpoint of an
      auto-resume damaged without start_over_if_no_intact_checkpoint=true; a failed save, e.g. a full disk: the
      line names the last good checkpoint)
  3   stopped by the non-finite guard: max_consecutive_nonfinite steps in a row had non-finite rewards, advantages,
      loss or gradient, or one update made the parameters non-finite or >10x larger (the message names the cause
      and the newest checkpoint, which predates it; grpo_dist/nonfinite.py)
  4   a collective failed because another rank died, stopped or hung (one line names that rank and its last
      phase; grpo_dist/watchdog.py; resume with resume_from_checkpoint=auto)
  5   cannot learn: a health condition named in health.stop_on held (grpo_dist/health.py; a checkpoint is written
      first when saving is configured), or the --dry-run verdict was "cannot learn" (grpo_dist/dry_run.py)
  6   the --dry-run verdict was "cannot tell yet": every completion of the rehearsal scored 0 (or 1), too few to
      tell a rare success from none (grpo_dist/dry_run.py has the formula)
  75  stopped by SIGTERM/SIGUSR1 (or because torchrun died), or by a first Ctrl-C during training, after writing a
      checkpoint (requeue and resume with resume_from_checkpoint=auto)
  130 aborted by a second Ctrl-C (or a Ctrl-C before training started), without a checkpoint
      (grpo_dist/interrupts.py)
Plain torchrun exits 1 whenever a worker fails; launch/torchrun.sh and the sbatch scripts pass the workers' code
through.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

# Set by the launchers: each rank writes its exit code into this folder (see _report).
EXIT_CODE_DIR_ENV = "GRPO_DIST_EXIT_CODE_DIR"


def parse_args(argv=None):
    """--config FILE, and overrides as key=value, --key value or --key=value (any config key, dotted too)."""
    from grpo_dist.config import expand_flags
    p = argparse.ArgumentParser(prog="python -m grpo_dist.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (keys documented by `python -m grpo_dist.config`)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. beta=0 model.dtype=bfloat16; "
                   "or argparse style: --learning_rate 1e-6, --model.dtype=bfloat16")
    words = sys.argv[1:] if argv is None else list(argv)
    return p.parse_args(expand_flags(words, keep=("--config", "-h", "--help")))


def main(argv=None) -> int:
    from grpo_dist.interrupts import abort_before_training
    abort_before_training(is_main=os.environ.get("RANK", "0") == "0")  # the training loop handles Ctrl-C itself
    from grpo_dist import dry_run
    from grpo_dist.config import ConfigError, load_config
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        given = cfg
        if cfg.dry_run:  # the rehearsal's own config: never the user's output_dir
            cfg = dry_run.prepare(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        print(f"grpo_dist: config error: {e}", file=sys.stderr)
        return _report(2)

    from grpo_dist import determinism
    determinism.apply(cfg.deterministic)  # before any CUDA kernel: cuBLAS reads its workspace setting once

    from transformers.utils import logging as hf_logging

    from grpo_dist import distributed as gdist
    from grpo_dist import preflight, watchdog
    from grpo_dist.async_rollout import PeerLost
    from grpo_dist.advice import start_warnings
    from grpo_dist.batch_source import RewardFunctionError
    from grpo_dist.checkpoint import CheckpointError
    from grpo_dist.data import DataError
    from grpo_dist.metrics import MetricsWriteError
    from grpo_dist.runlock import stop_when_parent_dies
    from grpo_dist.trainer import NONFINITE_EXIT_CODE, GRPOTrainer, NonFiniteError

    hf_logging.disable_progress_bar()  # no per-checkpoint "Writing model shards" bars in the logs
    stop_when_parent_dies()
    ctx = gdist.init_distributed(cfg.distributed.timeout_s, cfg.distributed.num_threads)
    watchdog.start(ctx.rank, ctx.world_size, cfg.distributed.timeout_s)  # a failed collective names the failed rank
    code, lock = 1, None
    try:
        lock = preflight.run(cfg, ctx)  # before any model loads; rank 0 holds the output_dir lock from here on
        if ctx.is_main:
            for line in start_warnings(cfg):  # settings that run but are probably not what was meant
                print(f"[grpo_dist] {line}", flush=True)
        if cfg.rollout_ranks:  # asynchronous GRPO: a rollout rank serves until the trainers stop it
            from grpo_dist import async_rollout
            roles, own = async_rollout.setup(cfg, ctx)  # own: this rank's group (the trainers or the rollout ranks)
            if not roles.is_trainer:
                served = async_rollout.serve(cfg, roles, own)
                code = served if served is not None else 1
                return code
        # data, model and resume checks: a failure leaves config.yaml as it was
        trainer = GRPOTrainer(cfg, own if cfg.rollout_ranks else ctx)
        rehearsal = dry_run.DryRun(trainer, given) if cfg.dry_run else None
        if ctx.is_main:  # only a run that started describes output_dir: a failed start must not rewrite it
            cfg.save(Path(cfg.output_dir) / "config.yaml")
        code = trainer.train()
        if rehearsal is not None:
            code = rehearsal.finish(code)
        elif ctx.is_main and code == 0 and not trainer.was_finished:
            print(f"[grpo_dist] done: step {trainer.step}; outputs in {Path(cfg.output_dir).resolve()} "
                  f"(config.yaml, metrics.jsonl, checkpoint-*/)", flush=True)
    except (ConfigError, DataError, CheckpointError, RewardFunctionError, MetricsWriteError) as e:
        # these are raised on every rank from one shared verdict: printed once, by rank 0
        if ctx.is_main or not isinstance(e, (preflight.AgreedError, CheckpointError, RewardFunctionError,
                                             MetricsWriteError)):
            kind = "ConfigError" if isinstance(e, preflight.AgreedError) else type(e).__name__
            print(f"grpo_dist: rank {ctx.rank}: {kind}: {e}", file=sys.stderr)
        code = 2
    except PeerLost as e:  # async_rollout: a rollout or trainer rank died, stopped or hung; the line names it
        seen = watchdog.peer_report(e.peer) if e.peer is not None else None
        print(f"grpo_dist: {e}" + (f"; {seen}" if seen else ""), file=sys.stderr, flush=True)
        code = watchdog.PEER_FAILURE_EXIT_CODE
    except NonFiniteError as e:
        if ctx.is_main:  # an all-reduced verdict: every rank raises the same error
            print(f"grpo_dist: rank {ctx.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        code = NONFINITE_EXIT_CODE
    except RuntimeError as e:
        if ctx.world_size < 2 or not watchdog.is_collective_failure(e):
            raise
        code = watchdog.report(e)  # another rank died, stopped or hung: one line names it and its phase
    finally:
        watchdog.finish(code)
        gdist.cleanup()
        if lock is not None:
            lock.release()
        if cfg.dry_run and ctx.is_main:
            import shutil
            shutil.rmtree(cfg.output_dir, ignore_errors=True)
        _report(code)
    # Skip the interpreter's final garbage collection over every torch/transformers object (seconds on a busy
    # host), which would eat into a preemption's grace period; everything is written and closed by now.
    gc.freeze()
    return code


def _report(code: int) -> int:
    """Under the launchers (launch/torchrun.sh, the sbatch scripts), write this rank's exit code where they read
    it: torchrun itself exits 1 whatever its workers returned."""
    folder = os.environ.get(EXIT_CODE_DIR_ENV)
    if folder:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n")
        except OSError:
            pass  # the launcher then reports torchrun's own status
    return code


if __name__ == "__main__":
    exit_code = main()  # outputs written and closed, the process group destroyed, the exit code reported
    # Leave without the interpreter's teardown: under torchrun it sometimes aborted a finished rank ("terminate
    # called without an active exception", SIGABRT: a C++ thread meeting a finalizing interpreter, as
    # tests/dist_utils.py records), and torchrun then reported a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

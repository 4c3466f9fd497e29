"""`torchrun --nproc_per_node N -m grpo_dist.train --config configs/X.yaml [key=value ...]`

Also runs as a plain single process (`python -m grpo_dist.train ...`). Exit codes: 0 done, 2 bad config or data,
3 stopped after max_consecutive_nonfinite steps in a row had a NaN/inf loss or gradient (the last checkpoint is
intact), 75 stopped by SIGTERM/SIGUSR1 after writing a checkpoint (requeue and resume with
resume_from_checkpoint=auto).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m grpo_dist.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (keys documented by `python -m grpo_dist.config`)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. beta=0 model.dtype=bfloat16")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.data import DataError
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"grpo_dist: config error: {e}", file=sys.stderr)
        return 2

    from transformers.utils import logging as hf_logging

    from grpo_dist import distributed as gdist
    from grpo_dist.checkpoint import CheckpointError
    from grpo_dist.trainer import NONFINITE_EXIT_CODE, GRPOTrainer, NonFiniteError

    hf_logging.disable_progress_bar()  # no per-checkpoint "Writing model shards" bars in the logs

    ctx = gdist.init_distributed(cfg.distributed.timeout_s, cfg.distributed.num_threads)
    try:
        if ctx.is_main:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            cfg.save(Path(cfg.output_dir) / "config.yaml")
        trainer = GRPOTrainer(cfg, ctx)
        code = trainer.train()
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"grpo_dist: rank {ctx.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 2
    except NonFiniteError as e:
        print(f"grpo_dist: rank {ctx.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        code = NONFINITE_EXIT_CODE
    finally:
        gdist.cleanup()
    # Skip the interpreter's final garbage collection over every torch/transformers object (seconds on a busy
    # host), which would eat into a preemption's grace period; everything is written and closed by now.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())

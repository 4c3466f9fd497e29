"""The non-finite-loss stop names an override that the config parser accepts (it once advised
distributed.mixed_precision=None, which the parser refuses)."""

import re

import pytest

from helpers import EQUIV_BASE as BASE


def test_nonfinite_stop_advises_an_override_that_parses():
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer, NonFiniteError
    extra = ["prompts_per_rank=4", "output_dir=/tmp/unused_nonfinite", "max_consecutive_nonfinite=1"]
    tr = GRPOTrainer(load_config(None, BASE + extra + ["distributed.mixed_precision=bf16"]), init_distributed(60))
    with pytest.raises(NonFiniteError) as err:
        tr._track_nonfinite(all_applied=False)
    advised = re.findall(r"distributed\.mixed_precision=\S+", str(err.value))
    assert len(advised) == 1
    cfg = load_config(None, BASE + extra + ["distributed.mixed_precision=bf16", advised[0]])
    assert cfg.distributed.mixed_precision is None

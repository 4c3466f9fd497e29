"""Command-line flags as TRL's and transformers' scripts take them (--key value, --key=value, dotted keys), TRL key
names answered with the settings to use here, and "did you mean" only for plausible typos."""

import pytest

from grpo_dist.config import ConfigError, expand_flags, load_config, main
from grpo_dist.train import parse_args
from grpo_dist.config.trl_names import TRL_NAMES, edit_distance, typo_of

pytestmark = pytest.mark.fast


def test_argparse_style_flags_become_overrides():
    words = ["--config", "c.yaml", "--learning_rate", "1e-6", "--beta=0", "--model.dtype", "bfloat16",
             "--progress-bar", "false", "--kl_in_reward", "--bf16", "num_generations=4", "--top_k", "-1"]
    assert expand_flags(words, keep=("--config",)) == [
        "--config", "c.yaml", "learning_rate=1e-6", "beta=0", "model.dtype=bfloat16", "progress_bar=false",
        "kl_in_reward=true", "bf16=true", "num_generations=4", "top_k=-1"]


def test_train_takes_flags_next_to_key_value():
    args = parse_args(["--config", "configs/smoke_cpu.yaml", "--learning_rate", "1e-6", "--model.dtype=bfloat16",
                       "max_steps=3", "--distributed.mixed_precision", "bf16"])
    assert args.config == "configs/smoke_cpu.yaml"
    cfg = load_config(args.config, args.overrides)
    assert (cfg.learning_rate, cfg.model.dtype, cfg.max_steps, cfg.distributed.mixed_precision) == \
        (1e-6, "bfloat16", 3, "bf16")


def test_a_flag_without_its_value_is_named():
    with pytest.raises(ConfigError, match=r"^command line: flag --learning_rate needs a value: --learning_rate "
                                          r"VALUE, --learning_rate=VALUE or learning_rate=VALUE$"):
        expand_flags(["--learning_rate", "--beta", "0"])


def _problem(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    assert len(e.value.problems) == 1
    return e.value.problems[0]


def test_trl_batch_names_get_the_arithmetic_for_the_users_values():
    # completions per rank per step = per_device_train_batch_size x gradient_accumulation_steps = 16 x 1;
    # prompts_per_rank = 16 / num_generations = 16 / 8 = 2
    p = _problem("per_device_train_batch_size=16", "num_generations=8")
    assert p.endswith("for 16 (x gradient_accumulation_steps=1) with num_generations=8 set prompts_per_rank=2 "
                      "micro_batch_size=16 (2 x 8 = 16 completions per rank per step)")
    assert "did you mean" not in p and "generation_batch_size" not in p
    # 12 x 1 = 12 is not a multiple of 8: 1 x 8 = 8 or 2 x 8 = 16
    assert "prompts_per_rank=1 gives 8, prompts_per_rank=2 gives 16" in _problem("per_device_train_batch_size=12")
    # prompts_per_rank x num_generations = 4 x 8 = 32 completions per rank; 32 / 4 accumulation steps = 8
    assert _problem("gradient_accumulation_steps=4", "prompts_per_rank=4", "num_generations=8").endswith(
        "with 32 completions per rank, gradient_accumulation_steps=4 is micro_batch_size=8 (32 / 4)")


def test_other_trl_names_map_to_this_trainers_keys():
    epochs = _problem("num_train_epochs=3", "prompts_per_rank=2")
    assert "max_steps = 3 x ceil(N / (2 x W))" in epochs and "num_iterations" not in epochs
    assert _problem("bf16=true").endswith("a TRL / transformers name; set distributed.mixed_precision=bf16")
    assert _problem("gradient_checkpointing=true").endswith("set distributed.activation_checkpointing=true")
    assert "set rollout_engine=vllm" in _problem("use_vllm=true")
    assert _problem("max_prompt_length=256").endswith("set data.max_prompt_length=256 (prompts are truncated from "
                                                      "the left, as in TRL)")
    # warmup_steps = ceil(warmup_ratio x max_steps) = ceil(0.1 x 50) = 5
    assert _problem("warmup_ratio=0.1", "max_steps=50").endswith("set warmup_steps=5 (ceil(0.1 x max_steps=50))")
    # TRL names that are keys here too are taken as they are
    cfg = load_config(None, ["learning_rate=1e-6", "num_generations=4", "beta=0.0", "epsilon=0.2",
                             "max_completion_length=64", "logging_steps=5", "save_steps=10"])
    assert (cfg.learning_rate, cfg.num_generations, cfg.logging_steps, cfg.save_steps) == (1e-6, 4, 5, 10)
    assert not set(TRL_NAMES) & {"learning_rate", "num_generations", "beta", "epsilon", "max_completion_length",
                                 "logging_steps", "save_steps"}


def test_did_you_mean_only_for_plausible_typos():
    assert "(did you mean 'learning_rate'?)" in _problem("learnig_rate=1e-6")
    assert "(did you mean 'model.dtype'?)" in _problem("model.dtyp=bfloat16")
    assert "(did you mean TRL's 'max_prompt_length'? here: data.max_prompt_length: set data.max_prompt_length=9 (" \
        in _problem("max_prompt_lenght=9")
    assert "did you mean" not in _problem("batch_size=8")  # 6 edits from micro_batch_size: not a typo
    # optimal string alignment: a transposition is one edit; kitten -> sitting is 3
    assert (edit_distance("widht", "width"), edit_distance("kitten", "sitting"), edit_distance("", "abc")) == (1, 3, 3)
    # at most one edit per 5 characters: 'epsilom' (7 chars, 1 edit) is a typo, 'lr' of nothing
    assert typo_of("epsilom", ["epsilon", "beta"]) == "epsilon" and typo_of("lr", ["seed", "beta"]) is None


def test_check_takes_the_same_flags(capsys):
    assert main(["--check", "none", "--learning_rate", "1e-6", "--model.dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "learning_rate: 1.0e-06" in out and "dtype: bfloat16" in out
    assert main(["--check", "none", "--per_device_train_batch_size", "16"]) == 2
    assert "command line: unknown config key 'per_device_train_batch_size': a TRL / transformers name" in \
        capsys.readouterr().err


def test_trl_loss_type_values_are_translated_in_the_message():
    assert _problem("loss_type=grpo").endswith("choose one of token_mean, seq_mean_token_mean, seq_mean_token_sum, "
                                               "dr_grpo (TRL's loss_type=grpo is loss_type=seq_mean_token_mean "
                                               "(each completion's token mean, averaged over completions) here)")
    assert "is loss_type=token_mean (over every completion token" in _problem("loss_type=dapo")
    assert "TRL's" not in _problem("loss_type=mean")

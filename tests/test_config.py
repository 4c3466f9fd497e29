"""Config loading: YAML + dotted overrides, clear errors naming the key."""

import re

import pytest

from grpo_dist.config import ConfigError, GRPOConfig, load_config

pytestmark = pytest.mark.fast  # the `make fast` tier


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("beta: 0.1\nmodel:\n  dtype: bfloat16\nlearning_rate: 1e-5\n")
    cfg = load_config(f, ["beta=0", "model.attn_implementation=eager", "report_to=[jsonl, tensorboard]"])
    assert cfg.beta == 0.0 and cfg.model.dtype == "bfloat16" and cfg.learning_rate == 1e-5
    assert cfg.model.attn_implementation == "eager" and cfg.report_to == ["jsonl", "tensorboard"]
    out = tmp_path / "resolved.yaml"
    cfg.save(out)
    assert load_config(out).to_dict() == cfg.to_dict()  # the resolved config reloads to the same config


@pytest.mark.parametrize("overrides, needle", [
    (["betta=0.1"], "unknown config key 'betta' (did you mean 'beta'?)"),
    (["model.dtyp=float32"], "unknown config key 'model.dtyp'"),
    (["loss_type=mean"], "config key 'loss_type' = 'mean' is not allowed"),
    (["max_steps=ten"], "config key 'max_steps' must be an integer"),
    (["num_generations=1"], "num_generations"),
    (["top_p=0"], "top_p"),
    (["distributed.sharding_strategy=ALL"], "distributed.sharding_strategy"),
    (["rewards=[{function: nocolon}]"], "rewards[0].function"),
    (["beta"], "key=value"),
])
def test_bad_keys_and_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_errors_name_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  name_or_pth: x\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:2: unknown config key 'model.name_or_pth'"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_defaults_are_valid():
    cfg = GRPOConfig()
    assert cfg.clip_high == cfg.epsilon


# ---------------------------------------------------------------- values the types alone let through

@pytest.mark.parametrize("override,key", [
    ("learning_rate=-1e-6", "learning_rate"), ("learning_rate=.nan", "learning_rate"),
    ("temperature=.nan", "temperature"), ("beta=.nan", "beta"), ("warmup_steps=-1", "warmup_steps"),
    ("max_grad_norm=-1", "max_grad_norm"), ("reward_workers=-1", "reward_workers"), ("eval_steps=-1", "eval_steps"),
    ("save_steps=-1", "save_steps"), ("top_k=-1", "top_k"), ("weight_decay=-0.1", "weight_decay"),
    ("adam_beta1=1.0", "adam_beta1"), ("adam_beta2=-0.1", "adam_beta2"), ("adam_beta2=1.5", "adam_beta2"),
    ("reward_timeout_s=0", "reward_timeout_s"), ("distributed.timeout_s=0", "distributed.timeout_s"),
    ("generation_batch_size=0", "generation_batch_size"), ("data.max_prompt_length=0", "data.max_prompt_length"),
    ("rewards=[]", "rewards"), ("epsilon_high=-0.2", "epsilon_high"), ("epsilon=-0.2", "epsilon"),
])
def test_bad_values_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert f"config key '{key}'" in msg, msg
    # only the key at fault is named (the epsilon message used to name three)
    others = {"epsilon", "epsilon_high", "beta"} - {key}
    assert not any(f"'{k}'" in msg for k in others), msg


def test_error_blames_the_command_line_or_the_file(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("learning_rate: -1.0\nmax_steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(yml))}:1: config key 'learning_rate'"):
        load_config(yml)
    yml.write_text("max_steps: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(yml, ["temperature=-1"])
    assert str(err.value).startswith("command line: config key 'temperature'") and str(yml) not in str(err.value)


def test_string_key_from_the_command_line_is_text():
    cfg = load_config(None, ["data.system_prompt=End with: The final answer is N.", "output_dir=runs/a: b"])
    assert cfg.data.system_prompt == "End with: The final answer is N."
    assert cfg.output_dir == "runs/a: b"
    assert load_config(None, ["data.system_prompt=null"]).data.system_prompt is None
    assert load_config(None, ["max_steps=7"]).max_steps == 7  # other keys are still parsed as YAML

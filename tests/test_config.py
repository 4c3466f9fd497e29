"""Config loading: YAML + dotted overrides, clear errors naming the key."""

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
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'model.name_or_pth'"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_defaults_are_valid():
    cfg = GRPOConfig()
    assert cfg.clip_high == cfg.epsilon

"""Every file in configs/ loads, validates and can be used: typed keys, data preset files and fields, reward
functions, prompt rendering, and a usage line in its header. One fast test per file (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_dist.config import load_config
from grpo_dist.data import DataError, PromptExample, data_dir, load_examples, render_prompt, resolve_data_config
from grpo_dist.rewards import resolve_reward_function

pytestmark = pytest.mark.fast  # the `make fast` tier

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _data_available() -> bool:
    try:
        return data_dir() is not None  # the offline mirror; without it presets would ask the Hub
    except DataError:
        return False


class _NoChatTokenizer:
    chat_template = None


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    for required in ("smoke_cpu.yaml", "demo_cpu.yaml", "qwen2.5_0.5b_gsm8k.yaml", "qwen2.5_math_1.5b_gsm8k.yaml",
                     "qwen3_0.6b_math.yaml", "qwen2.5_7b_multinode.yaml"):
        assert required in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(path: Path):
    cfg = load_config(path)  # typed keys, choices, ranges (raises ConfigError naming the key)
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert header, f"{path.name}: needs a comment header saying what it is and how to run it"
    assert any(("torchrun" in h or "launch/" in h or "grpo_dist.train" in h) for h in header), \
        f"{path.name}: the header should show the command that runs it"
    assert cfg.model.name_or_path or cfg.model.tiny, f"{path.name}: no model"

    # Rewards: every function imports and grades a string pair to a float.
    for spec in cfg.rewards:
        fn = resolve_reward_function(spec["function"])
        assert isinstance(float(fn("17", "17")), float)

    # Data: preset defaults resolve; preset files (when the shared data folder is here) load with the fields named.
    rcfg = resolve_data_config(cfg.data)
    assert "{prompt}" in rcfg.prompt_template
    if cfg.data.preset == "arithmetic" or _data_available():
        train = load_examples(cfg.data, "train")
        assert len(train) >= cfg.prompts_per_rank, f"{path.name}: fewer training prompts than one rank's batch"
        evals = load_examples(cfg.data, "eval")
        if cfg.eval_steps:
            assert evals, f"{path.name}: eval_steps is set but there is no held-out split"
        example = train[0]
    else:
        example = PromptExample(prompt="What is 1+1?", answer="2", index=0)
    if not cfg.data.use_chat_template:
        text = render_prompt(example, cfg.data, _NoChatTokenizer()).text
        assert example.prompt in text

    # Batch shapes that the trainer relies on.
    assert cfg.num_generations >= 2
    if cfg.distributed.mixed_precision is not None or "qwen" in path.name:
        assert cfg.learning_rate <= 1e-4, f"{path.name}: real-model learning rates are ~1e-6..1e-5"


def test_demo_config_matches_base_model_task():
    """The demo trains on the task the base model was warm-started on (same operands, same held-out split)."""
    from grpo_dist.tools.demo import BaseSettings, arithmetic_opts
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml")
    from grpo_dist.tools.demo import SHIPPED_BASE
    assert (ROOT / cfg.model.name_or_path).resolve() == SHIPPED_BASE  # the shipped copy
    assert cfg.data.arithmetic == arithmetic_opts(BaseSettings())
    assert cfg.rewards[0]["function"] == "grpo_dist.rewards:number_match"
    assert cfg.max_completion_length >= len(str(2 * BaseSettings().max_operand)) + 1  # digits + EOS


def test_readme_lists_every_config():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in CONFIGS if f"`{p.name}`" not in readme]
    assert not missing, f"README's configs table lacks {missing}"


EXPS = sorted((ROOT / "configs" / "exp").glob("*.yaml"))


def test_experiment_overrides_exist():
    assert len(EXPS) >= 2, "configs/exp/ holds the shipped +exp=NAME overrides"


@pytest.mark.parametrize("exp", EXPS, ids=lambda p: p.stem)
def test_experiment_override_applies_to_every_config(exp: Path):
    """Each configs/exp/NAME.yaml has a header with its command, sets only known keys, and validates on top of
    every shipped config (the values it names are the ones the run gets)."""
    header = [line for line in exp.read_text().splitlines() if line.startswith("#")]
    assert any(f"+exp={exp.stem}" in h for h in header), f"{exp.name}: the header should show +exp={exp.stem}"
    import yaml
    values = yaml.safe_load(exp.read_text())
    assert values and "defaults" not in values
    for path in CONFIGS:
        cfg = load_config(path, [f"+exp={exp.stem}"])
        assert {k: getattr(cfg, k) for k in values} == values, f"{exp.name} on {path.name}"

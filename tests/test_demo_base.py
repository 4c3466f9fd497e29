"""The demo's base model is shipped (grpo_dist/tools/demo_base, package data), the same bytes on every machine; and
`build-base` still builds one for those who change it."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
def test_the_shipped_base_is_the_default_settings_model_and_package_data():
    from grpo_dist.tools.demo import SETTINGS_FILE, SHIPPED_BASE, BaseSettings
    meta = json.loads((SHIPPED_BASE / SETTINGS_FILE).read_text())
    assert meta["key"] == BaseSettings().key(), "BaseSettings changed: rebuild and re-ship the base (demo.py)"
    assert meta["parameters"] == 469632 and meta["made_by"]["command"].startswith("python -m grpo_dist.tools.demo")
    files = {p.name for p in SHIPPED_BASE.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    # setup.cfg's package_data covers every shipped file (a wheel without one would load nothing)
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = [p.strip() for p in cfg["options.package_data"]["grpo_dist.tools"].split(",")]
    assert all(any(Path("demo_base", f).match(p) for p in patterns) for f in files), (files, patterns)


def test_the_shipped_base_scores_its_recorded_held_out_accuracy(one_thread):
    """Greedy decoding of a fixed model: the recorded 40 % on any CPU (no training amplifies the kernels' rounding),
    loaded the way the demo loads it (configs/demo_cpu.yaml's model.name_or_path)."""
    from grpo_dist.config import load_config
    from grpo_dist.data import load_examples
    from grpo_dist.models import load_model, load_tokenizer
    from grpo_dist.tools.demo import SETTINGS_FILE, SHIPPED_BASE, greedy_accuracy
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml")
    assert (ROOT / cfg.model.name_or_path).resolve() == SHIPPED_BASE
    cfg.model.name_or_path = str(SHIPPED_BASE)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok)
    acc = greedy_accuracy(model, tok, load_examples(cfg.data, "eval"))
    assert acc == json.loads((SHIPPED_BASE / SETTINGS_FILE).read_text())["eval_greedy_accuracy"] == 0.4


def test_build_base_builds_and_caches_a_small_base(tmp_path):
    from grpo_dist.tools.demo import BaseSettings, build_base, main
    s = BaseSettings(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=32, sft_steps=10, sft_batch_size=8)
    out = build_base(tmp_path / "base", s, log=lambda *a: None)
    meta = json.loads((out / "demo_base.json").read_text())
    assert meta["key"] == s.key() and meta["parameters"] < 20000
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 16
    assert AutoTokenizer.from_pretrained(out).decode([10, 11]) != ""
    lines: list[str] = []
    build_base(tmp_path / "base", s, log=lines.append)  # same settings: the cached model, no rebuild
    assert len(lines) == 1 and lines[0].startswith("[demo] base model cached in"), lines
    # the command line builds the same way
    assert main(["build-base", "--out", str(tmp_path / "cli"), "--hidden-size", "16", "--num-hidden-layers", "1",
                 "--num-attention-heads", "2", "--num-key-value-heads", "1", "--intermediate-size", "32",
                 "--sft-steps", "10", "--sft-batch-size", "8"]) == 0
    assert json.loads((tmp_path / "cli" / "demo_base.json").read_text())["key"] == s.key()

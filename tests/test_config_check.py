"""Every config problem at once: ConfigError.problems and `python -m grpo_dist.config --check CONFIG [key=value]`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_dist.config import ConfigError, load_config, main

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
# One problem of each kind: a malformed override, an unknown key (top level and in a section), a value of the
# wrong type, a value outside its choices, and cross-key checks of GRPOConfig.validate.
BAD = ["beta", "betta=0.1", "model.dtyp=float32", "max_steps=ten", "loss_type=mean", "num_generations=1",
       "top_p=0", "rewards=[{function: nocolon}]"]
NEEDLES = ["override 'beta' must look like key=value", "unknown config key 'betta' (did you mean 'beta'?)",
           "unknown config key 'model.dtyp'", "config key 'max_steps' must be an integer",
           "config key 'loss_type' = 'mean' is not allowed", "config key 'num_generations' must be >= 2",
           "config key 'top_p' must be in (0, 1]", "config key 'rewards[0].function' must be 'module:function'"]


def test_load_config_collects_every_problem_and_the_message_counts_them():
    with pytest.raises(ConfigError) as e:
        load_config(None, BAD)
    assert len(e.value.problems) == len(NEEDLES)
    for needle, problem in zip(NEEDLES, e.value.problems):
        assert needle in problem
    assert str(e.value) == f"{e.value.problems[0]} (and {len(NEEDLES) - 1} more problems)"


def test_one_problem_keeps_the_one_line_message(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("temperature: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == f"{f}:1: config key 'temperature' must be > 0, got 0.0" and len(e.value.problems) == 1


def test_check_prints_the_resolved_config(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("beta: 0.1\nmodel:\n  dtype: bfloat16\n")
    assert main(["--check", str(f), "num_generations=4", "data.limit=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == load_config(f, ["num_generations=4", "data.limit=3"]).to_dict()
    assert printed["beta"] == 0.1 and printed["model"]["dtype"] == "bfloat16" and printed["num_generations"] == 4


def test_check_lists_every_problem_of_file_and_overrides_and_exits_2(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("temperature: 0\ndistributed:\n  sharding_strategy: ALL\n")
    assert main(["--check", str(f), *BAD]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and lines[0] == f"{f}: {len(NEEDLES) + 2} problem(s)"
    for needle in NEEDLES + ["config key 'temperature' must be > 0", "config key 'distributed.sharding_strategy'"]:
        assert sum(needle in line for line in lines[1:]) == 1, needle


# Checks that live next to the code they guard (data, model.tiny, the DeepSpeed engine) but need no file and no
# model: GRPOConfig.problems() reports them with the rest.
BAD_ELSEWHERE = ["data.limit=0", "data.arithmetic={ops: '/'}", "data.prompt_template=no placeholder",
                 "model.tiny={architecture: gpt9, widht: 3}", "distributed.backend=deepspeed", "save_format=sharded"]
NEEDLES_ELSEWHERE = ["config key 'data.limit' must be >= 1", "config key 'data.arithmetic.ops'",
                     "config key 'data.prompt_template' must contain '{prompt}'",
                     "unknown config key 'model.tiny.widht'", "config key 'model.tiny.architecture' = 'gpt9'",
                     "config key 'save_format' = sharded"]


def test_data_tiny_model_and_deepspeed_problems_are_config_problems(capsys):
    assert main(["--check", "none", *BAD_ELSEWHERE]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"config: {len(NEEDLES_ELSEWHERE)} problem(s)"
    for needle, line in zip(NEEDLES_ELSEWHERE, lines[1:]):
        assert line.startswith("  command line: ") and needle in line, (needle, line)
    with pytest.raises(ConfigError, match="data.arithmetic.num_examples. = 900000 is too large"):
        load_config(None, ["data.arithmetic={max_operand: 999, num_examples: 900000}"])
    # options of a set that is not used, and a tiny model that is not built, are not checked
    load_config(None, ["data.arithmetic={ops: '/'}", "data.path=train.jsonl"])
    load_config(None, ["model.tiny={architecture: gpt9}", "model.name_or_path=some/model"])


def test_check_without_a_config_is_a_usage_error_and_no_arguments_list_the_keys(capsys):
    assert main(["--check"]) == 2
    assert "usage: python -m grpo_dist.config" in capsys.readouterr().err
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "num_generations = 8  # completions per prompt" in out and "[model]" in out


def test_module_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = [sys.executable, "-m", "grpo_dist.config", "--check", "none"]
    ok = subprocess.run(run + ["beta=0"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and yaml.safe_load(ok.stdout)["beta"] == 0.0, ok.stderr
    bad = subprocess.run(run + ["betta=0", "top_p=2"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert bad.returncode == 2 and "config: 2 problem(s)" in bad.stderr and "top_p" in bad.stderr

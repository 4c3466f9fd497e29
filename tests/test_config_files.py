"""`python -m grpo_dist.config --check` and load_config: a key written wrong in a YAML file is named with the file
and its line (nested keys too), and the data files the config names are checked without loading them."""

import json

import pytest

from grpo_dist.config import ConfigError, load_config, main, yaml_key_lines

pytestmark = pytest.mark.fast

YAML = """\
max_steps: 3
model:
  tiny: {architecture: qwen2, widht: 3}
data:
  promt_field: q
rewards:
  - {function: "grpo_dist.rewards:math_reward", weight: 1.0}
  - {function: nocolon}
learnig_rate: 1.0e-5
"""


def test_yaml_key_lines_cover_nested_keys_and_list_items():
    lines = yaml_key_lines(YAML)
    assert (lines["max_steps"], lines["model"], lines["model.tiny"], lines["model.tiny.widht"],
            lines["data.promt_field"], lines["rewards[1]"], lines["rewards[1].function"], lines["learnig_rate"]) == \
        (1, 2, 3, 3, 5, 8, 8, 9)


def test_typos_in_a_yaml_file_name_file_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(YAML)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    got = sorted(p.split(" (did you mean")[0].split("; allowed")[0].split(" must be")[0] for p in e.value.problems)
    assert got == [f"{f}:3: unknown config key 'model.tiny.widht'",
                   f"{f}:5: unknown config key 'data.promt_field'",
                   f"{f}:8: config key 'rewards[1].function'",
                   f"{f}:9: unknown config key 'learnig_rate'"]


def test_the_command_line_is_still_named_as_such(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"^command line: unknown config key 'max_stpes'"):
        load_config(f, ["max_stpes=4"])


def _check(args, capsys):
    code = main(["--check", *args])
    return code, [ln.strip() for ln in capsys.readouterr().err.splitlines()[1:]]


def test_check_refuses_a_data_path_that_does_not_exist_with_file_and_line(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\ndata:\n  preset: null\n  path: nope.jsonl\n")
    code, lines = _check([str(f)], capsys)
    assert code == 2 and lines == [f"{f}:4: config key 'data.path' = nope.jsonl: no such file"]
    code, lines = _check(["none", f"data.eval_path={tmp_path}"], capsys)
    assert code == 2 and lines == [f"command line: config key 'data.eval_path' = {tmp_path} is a directory, not a "
                                   f"data file"]


def test_check_reads_the_first_row_for_the_configured_fields(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    base = ["none", "data.preset=null", f"data.path={rows}"]
    code, lines = _check(base, capsys)
    assert code == 2 and lines == [f"command line: config key 'data.path' = {rows}: {rows}:1: missing field "
                                   f"'question' (fields present: problem, solution)"]
    code, lines = _check(base + ["data.prompt_field=problem", "data.answer_field=solution",
                                 "data.answer_format=boxed"], capsys)
    assert code == 2 and "field 'solution': no \\boxed{...} in the answer" in lines[0]
    assert main(["--check", *base, "data.prompt_field=problem", "data.answer_field=solution"]) == 0
    weird = tmp_path / "rows.csv"
    weird.write_text("a,b\n")
    code, lines = _check(["none", "data.preset=null", f"data.path={weird}"], capsys)
    assert code == 2 and "unsupported data file type '.csv'" in lines[0]

"""Composable configs (grpo_dist/config/compose.py): `defaults:` chains, deep merge of sections, cycles, `+exp=NAME`,
the command line winning, where each value came from (`--check`), the resolved config as the one source for resume
and evaluate, and the config module without its old import circle. No model is loaded."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_dist.config import ConfigError, load_config, main

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
SMALL = "model: {tiny: {architecture: qwen2, hidden_size: 32, num_hidden_layers: 1}}\n"


def write(folder: Path, name: str, text: str) -> Path:
    p = folder / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_defaults_merge_in_order_then_the_file(tmp_path):
    write(tmp_path, "a.yaml", SMALL + "max_steps: 1\nseed: 1\nlearning_rate: 1.0e-3\n")
    write(tmp_path, "b.yaml", "max_steps: 2\nseed: 2\n")
    main_cfg = write(tmp_path, "main.yaml", "defaults: [a.yaml, b.yaml]\nseed: 3\n")
    cfg = load_config(main_cfg)
    # b over a (later default wins), the file over both, a's key that nobody else sets survives
    assert (cfg.max_steps, cfg.seed, cfg.learning_rate) == (2, 3, 1e-3)
    assert cfg.model.tiny == {"architecture": "qwen2", "hidden_size": 32, "num_hidden_layers": 1}


def test_sections_merge_key_by_key_lists_replace_and_paths_are_relative_to_each_file(tmp_path):
    write(tmp_path, "root.yaml", SMALL + "data:\n  preset: arithmetic\n  max_prompt_length: 32\n"
          "  arithmetic: {max_operand: 9, seed: 1}\n"
          "rewards:\n  - {function: 'grpo_dist.rewards:math_reward'}\n"
          "  - {function: 'grpo_dist.rewards:digit_overlap', weight: 0.5}\n")
    write(tmp_path, "sub/mid.yaml", "defaults: [../root.yaml]\ndata:\n  arithmetic: {seed: 2}\n")
    # `..` is fine inside the top config's folder (tmp_path): root.yaml is reached from sub/
    top = write(tmp_path, "top.yaml", "defaults: [sub/mid.yaml]\ndata: {limit: 10}\n"
                "rewards: [{function: 'grpo_dist.rewards:number_match'}]\n")
    cfg = load_config(top)
    assert (cfg.data.preset, cfg.data.max_prompt_length, cfg.data.limit) == ("arithmetic", 32, 10)
    assert cfg.data.arithmetic == {"max_operand": 9, "seed": 2}  # a mapping merges too, key by key
    assert cfg.rewards == [{"function": "grpo_dist.rewards:number_match"}]  # a list replaces, never appends


def test_a_cycle_in_defaults_is_one_line_naming_the_files(tmp_path):
    a = write(tmp_path, "a.yaml", "defaults: [b.yaml]\nseed: 1\n")
    b = write(tmp_path, "b.yaml", "defaults: [c.yaml]\n")
    c = write(tmp_path, "c.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert len(e.value.problems) == 1 and "\n" not in str(e.value)
    assert "cycle" in str(e.value)
    assert f"{a.resolve()} -> {b.resolve()} -> {c.resolve()} -> {a.resolve()}" in str(e.value)
    self_loop = write(tmp_path, "self.yaml", "defaults: [self.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(self_loop)


def test_a_missing_default_and_a_bad_defaults_value_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"main\.yaml: config key 'defaults' names config file not found: .*nope"):
        load_config(write(tmp_path, "main.yaml", "defaults: [nope.yaml]\n"))
    with pytest.raises(ConfigError, match=r"bad\.yaml:2: config key 'defaults' must be a list"):
        load_config(write(tmp_path, "bad.yaml", "seed: 1\ndefaults: {a: 1}\n"))


def test_unknown_keys_are_named_with_the_file_and_line_they_are_written_in(tmp_path):
    write(tmp_path, "base.yaml", SMALL + "seed: 1\ndata:\n  promt_field: q\n")
    main_cfg = write(tmp_path, "main.yaml", "defaults: [base.yaml]\nmax_steps: 2\nlernig_rate: 1.0\n")
    write(tmp_path, "exp/typo.yaml", "# an experiment\nbeta: 0.1\nbetta: 0.2\n")
    with pytest.raises(ConfigError) as e:
        load_config(main_cfg, ["+exp=typo"])
    got = sorted(p.split(" (did you mean")[0].split("; allowed")[0].split(":")[-1].strip() + " @ " +
                 ":".join(p.split(":")[:2]) for p in e.value.problems)
    assert got == sorted([f"unknown config key 'data.promt_field' @ {tmp_path / 'base.yaml'}:4",
                          f"unknown config key 'lernig_rate' @ {main_cfg}:3",
                          f"unknown config key 'betta' @ {tmp_path / 'exp' / 'typo.yaml'}:3"])


def test_exp_files_apply_in_order_after_the_file_and_the_command_line_wins(tmp_path):
    main_cfg = write(tmp_path, "main.yaml", SMALL + "learning_rate: 1.0e-3\nbeta: 0.0\nseed: 5\n")
    write(tmp_path, "exp/one.yaml", "learning_rate: 1.0e-4\nbeta: 0.1\n")
    write(tmp_path, "exp/two.yaml", "learning_rate: 2.0e-4\n")
    cfg = load_config(main_cfg, ["+exp=one", "+exp=two"])
    assert (cfg.learning_rate, cfg.beta, cfg.seed) == (2e-4, 0.1, 5)  # two over one over the file
    cfg = load_config(main_cfg, ["+exp=two", "+exp=one"])
    assert cfg.learning_rate == 1e-4
    # key=value beats every +exp, wherever it is written among them
    cfg = load_config(main_cfg, ["learning_rate=7.0e-5", "+exp=one", "+exp=two", "beta=0.2"])
    assert (cfg.learning_rate, cfg.beta) == (7e-5, 0.2)
    with pytest.raises(ConfigError, match=r"^command line: \+exp=nothere: no such experiment file .*known: .*one, "
                                          r"two"):
        load_config(main_cfg, ["+exp=nothere"])


def test_shipped_exp_files_are_found_from_any_config(tmp_path):
    cfg = load_config(ROOT / "configs" / "smoke_cpu.yaml", ["+exp=lr_ablation", "+exp=beta_kl", "+exp=dr_grpo"])
    shipped = {**yaml.safe_load((ROOT / "configs/exp/lr_ablation.yaml").read_text()),
               **yaml.safe_load((ROOT / "configs/exp/beta_kl.yaml").read_text()),
               **yaml.safe_load((ROOT / "configs/exp/dr_grpo.yaml").read_text())}
    assert {k: getattr(cfg, k) for k in shipped} == shipped


def test_check_shows_where_each_value_came_from(tmp_path, capsys):
    write(tmp_path, "base.yaml", SMALL + "seed: 1\nmax_steps: 7\ndata:\n  limit: 50\n  max_prompt_length: 16\n")
    main_cfg = write(tmp_path, "main.yaml", "# header\ndefaults: [base.yaml]\nseed: 3\ndata:\n  limit: 20\n")
    write(tmp_path, "exp/e.yaml", "\nbeta: 0.1\n")
    assert main(["--check", str(main_cfg), "+exp=e", "max_steps=9", "--learning_rate", "3e-4"]) == 0
    out = capsys.readouterr().out
    where = dict(line[2:].split(" = ", 1) for line in out.splitlines() if line.startswith("# ") and " = " in line)
    base, top, exp = tmp_path / "base.yaml", main_cfg, tmp_path / "exp" / "e.yaml"
    assert where["seed"] == f"3  <- {top}:3"                       # the file over its default
    assert where["data.limit"] == f"20  <- {top}:5"                # a nested key from the file
    assert where["data.max_prompt_length"] == f"16  <- {base}:6"   # a nested key kept from the default
    assert where["model.tiny"].endswith(f"<- {base}:1")
    assert where["beta"] == f"0.1  <- {exp}:2"
    assert where["max_steps"] == "9  <- command line"              # over the default's 7
    assert where["learning_rate"] == "0.0003  <- command line"
    assert where["epsilon"] == "0.2  <- default"
    assert where["data.eval_limit"] == "64  <- default"            # in a section the files write, not written
    assert yaml.safe_load(out)["max_steps"] == 9  # stdout is still the resolved YAML (the lines are comments)


def test_the_resolved_config_is_the_single_source_for_evaluate_and_resume(tmp_path):
    """A run saves the merged config; evaluate (run_config) and a resumed run rebuild it from that file alone,
    even after the defaults chain and exp files have changed or gone."""
    from grpo_dist.tools.evaluate import run_config
    write(tmp_path, "base.yaml", SMALL + "seed: 1\ndata: {max_prompt_length: 16}\n")
    main_cfg = write(tmp_path, "main.yaml", f"defaults: [base.yaml]\noutput_dir: {tmp_path / 'run'}\n")
    write(tmp_path, "exp/e.yaml", "beta: 0.1\n")
    cfg = load_config(main_cfg, ["+exp=e", "max_steps=3"])
    out = tmp_path / "run"
    out.mkdir()
    cfg.save(out / "config.yaml")  # what train.py writes at start
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert "defaults" not in saved and saved["seed"] == 1 and saved["beta"] == 0.1
    (tmp_path / "base.yaml").write_text("seed: 99\n")  # the chain changes after the run started ...
    (tmp_path / "exp" / "e.yaml").unlink()             # ... or goes away
    d, source = run_config(str(out), str(out))
    assert source == str(out / "config.yaml")
    assert load_config(None, base=d).to_dict() == cfg.to_dict()
    # a resume names the saved file as its config: it loads as it is, no chain followed
    assert load_config(out / "config.yaml").to_dict() == cfg.to_dict()


def test_a_defaults_key_inside_a_saved_base_dict_is_not_followed(tmp_path):
    """`base` (a run's saved dict) is taken as resolved: a `defaults` entry there is an unknown key, not a chain."""
    with pytest.raises(ConfigError, match="unknown config key 'defaults'"):
        load_config(None, base={"defaults": ["x.yaml"]})


def test_the_arithmetic_defaults_of_the_data_section_are_the_generators():
    from grpo_dist.config.choices import ARITHMETIC_DEFAULTS
    from grpo_dist.data.arithmetic import synthetic_arithmetic
    params = inspect.signature(synthetic_arithmetic).parameters
    assert ARITHMETIC_DEFAULTS == {k: params[k].default for k in params if k != "split"}


def test_config_validation_imports_no_data_module_and_the_old_names_still_import():
    """The import circle is gone: building and checking a GRPOConfig needs nothing of grpo_dist.data (it used to
    import grpo_dist.data inside problems()), and grpo_dist.data imports its section, not grpo_dist.config."""
    code = ("import sys\n"
            "from grpo_dist.config import ConfigError, DataConfig, GRPOConfig, clip, short, _f, load_config\n"
            "GRPOConfig().validate()\n"
            "assert not [m for m in sys.modules if m.startswith('grpo_dist.data')], sorted(sys.modules)\n"
            "import grpo_dist.data.loading as L\n"
            "assert L.DataConfig is DataConfig\n"
            "from grpo_dist.data import data_config_problems\n"
            "assert data_config_problems(DataConfig(limit=0))\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for f in (ROOT / "grpo_dist" / "data").glob("*.py"):
        assert "from grpo_dist.config import" not in f.read_text(), f"{f.name} imports grpo_dist.config"


def test_the_option_listing_shows_defaults_and_exp(capsys):
    """`python -m grpo_dist.config` lists every dataclass key; `defaults` and `+exp=NAME` are none (config_compose
    reads them before the dataclasses), so the listing names them itself: what each does and where it is
    documented, with the shipped experiment files."""
    assert main([]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out[0]
    assert head.startswith("[composition]") and "docs/configs.md" in head and "config/compose.py" in head
    defaults = next(line for line in out if line.startswith("defaults = "))
    assert "in a config file" in defaults and "before the file itself" in defaults
    exp = next(line for line in out if line.startswith("+exp=NAME"))
    assert "on the command line" in exp and "configs/exp/" in exp
    shipped = sorted(p.stem for p in (ROOT / "configs" / "exp").glob("*.yaml"))
    assert shipped and all(name in exp for name in shipped)
    # the dataclass keys follow, as before
    assert any(line.startswith("num_generations = 8  # completions per prompt") for line in out)


# --------------------------------------------------------------------------- issue 39, cases 2 and 3
SECRET = "hunter2-do-not-print"


def test_defaults_outside_the_config_folder_are_refused_without_reading_them(tmp_path):
    """`defaults:` may name files under the top config's folder and the shipped configs only: an absolute path
    (`/etc/shadow` printed 24 of its lines as unknown keys on the code before) or a `..` escape is refused in one
    line that names the entry, and the file is never read, so nothing of it is printed."""
    outside = write(tmp_path, "outside/shadow.yaml", f"root: {SECRET}\n{SECRET}: 1\n")
    proj = tmp_path / "proj"
    for entry in (str(outside), "../outside/shadow.yaml", "/etc/shadow"):
        main_cfg = write(proj, "main.yaml", f"defaults: [{entry}]\nseed: 1\n")
        with pytest.raises(ConfigError) as err:
            load_config(main_cfg)
        msg = str(err.value)
        assert SECRET not in msg and len(msg.splitlines()) == 1, msg
        assert f"main.yaml:1: config key 'defaults' entry {entry!r}" in msg, msg
        assert "absolute" in msg if entry.startswith("/") else "outside" in msg, msg
    # a symlink inside the folder that points out of it is an escape too
    (proj / "link.yaml").symlink_to(outside)
    with pytest.raises(ConfigError, match="outside"):
        load_config(write(proj, "main.yaml", "defaults: [link.yaml]\n"))


def test_a_default_that_is_not_a_config_is_refused_without_its_contents(tmp_path):
    """A file in the folder that is not a config (not YAML, not a mapping, no config key at its top level, not a
    .yaml file) is refused naming the file only: none of its text is printed."""
    cases = {"notes.yaml": f"password: {SECRET}\nuser: {SECRET}\n",
             "broken.yaml": f"seed: [{SECRET}\n",
             "scalar.yaml": f"{SECRET}\n",
             "data.txt": "seed: 1\n"}
    for name, text in cases.items():
        write(tmp_path, name, text)
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, "main.yaml", f"defaults: [{name}]\n"))
        msg = str(err.value)
        assert SECRET not in msg and "password" not in msg and len(msg.splitlines()) == 1, (name, msg)
        assert name in msg, msg


def test_a_typo_in_a_real_default_is_still_named(tmp_path):
    """A default that is a config (some of its top-level keys are config keys) keeps the usual line for a typo."""
    write(tmp_path, "base.yaml", "seed: 1\nlernig_rate: 1.0\n")
    with pytest.raises(ConfigError, match=r"base\.yaml:2: unknown config key 'lernig_rate'"):
        load_config(write(tmp_path, "main.yaml", "defaults: [base.yaml]\n"))


def test_a_shipped_config_can_be_a_default_from_any_folder(tmp_path):
    """A name not found next to the file is looked up in the shipped configs (as +exp= names are)."""
    cfg = load_config(write(tmp_path, "main.yaml", "defaults: [smoke_cpu.yaml]\nmax_steps: 1\n"))
    assert cfg.max_steps == 1 and cfg.num_generations == 4 and cfg.data.preset == "arithmetic"


def test_a_diamond_of_defaults_reads_each_file_once(tmp_path, monkeypatch):
    """14 two-line files, each level's two naming both of the next level's: every file is reached 2^level times
    (127 reads on the code before, doubling with each level: 14 more files took over 100 s). Each file is read
    and expanded once; the merge is the same, and a cycle is still found."""
    import grpo_dist.config.compose as compose  # where the composer reads each file
    levels = 7
    for k in range(levels):
        for side in "ab":
            nxt = f"defaults: [a{k + 1}.yaml, b{k + 1}.yaml]\n" if k + 1 < levels else "max_steps: 3\n"
            write(tmp_path, f"{side}{k}.yaml", nxt + f"seed: {k}\n")
    top = write(tmp_path, "top.yaml", "defaults: [a0.yaml, b0.yaml]\nlearning_rate: 0.5\n")
    reads = []
    real = compose.load_yaml
    monkeypatch.setattr(compose, "load_yaml", lambda text, where: reads.append(where) or real(text, where))
    cfg = load_config(top)
    assert sorted(reads) == sorted({*reads}) and len(reads) == 2 * levels + 1, reads
    assert (cfg.seed, cfg.max_steps, cfg.learning_rate) == (0, 3, 0.5)  # the nearer level wins, as before
    write(tmp_path, f"b{levels - 1}.yaml", "defaults: [a2.yaml]\nseed: 9\n")  # a cycle deep in the diamond
    with pytest.raises(ConfigError, match="form a cycle"):
        load_config(top)

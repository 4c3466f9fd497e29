"""The shipped configs in a wheel install (issue 39, case 4): `+exp=NAME` and `defaults: [shipped.yaml]` found
without the source tree. A wheel is built from a copy of the project, installed with pip into a fresh prefix, and
imported from there with the working directory and PYTHONPATH away from the source tree (~10 s)."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_exp_and_shipped_defaults_are_found_in_a_wheel_install(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "grpo_dist", src / "grpo_dist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", src / "configs")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300, cwd=src)
    assert r.returncode == 0, r.stderr[-3000:]
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    wheel = next((tmp_path / "dist").glob("grpo_dist-*.whl"))
    r = subprocess.run(pip + ["--python", str(prefix / "bin" / "python"), "install", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(subprocess.run([str(prefix / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # yaml & co. from this environment
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "mine.yaml").write_text("defaults: [smoke_cpu.yaml]\nmax_steps: 1\n")
    code = ("import grpo_dist, grpo_dist.config as c\n"
            "cfg = c.load_config('mine.yaml', ['+exp=dr_grpo'])\n"
            "print(grpo_dist.__file__)\n"
            "print(cfg.loss_type, cfg.scale_rewards, cfg.max_steps, cfg.num_generations)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(prefix / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=work, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    where, values = r.stdout.strip().splitlines()
    assert where.startswith(str(site)), where  # the installed copy, not the source tree
    assert values == "dr_grpo none 1 4", values  # configs/exp/dr_grpo.yaml over smoke_cpu.yaml's values

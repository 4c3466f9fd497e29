"""Argument handling of the launchers: launch/torchrun.sh, launch/slurm/*.sbatch, docker/entrypoint.sh.

The scripts are run with bash, without SLURM or a GPU; DRY_RUN=1 makes them print the
command they would run. The real runs (a SLURM cluster, a container) are in
.ci/slurm_test.sh and .ci/container_test.sh.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = "launch/torchrun.sh"
ONE_NODE = "launch/slurm/train_1node.sbatch"
MULTI_NODE = "launch/slurm/train_multinode.sbatch"
ENTRYPOINT = "docker/entrypoint.sh"
SBATCH_SCRIPTS = [ONE_NODE, MULTI_NODE]
ALL_SCRIPTS = [TORCHRUN, *SBATCH_SCRIPTS, ENTRYPOINT, ".ci/slurm_up.sh", ".ci/slurm_down.sh",
               ".ci/slurm_test.sh", ".ci/container_test.sh"]
CONFIG = "configs/smoke_cpu.yaml"
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC", "NNODES", "MASTER_"))}
    full_env.update({"PYTHON": sys.executable, "SLURM_CONF": "/nonexistent/slurm.conf"})
    full_env.update(env)
    return subprocess.run(["bash", script, *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


def dry_run(script: str, *args: str, **env: str) -> list[str]:
    r = run(script, *args, DRY_RUN="1", **env)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout)


@pytest.fixture(autouse=True)
def _needs_config():
    if not (REPO / CONFIG).is_file():
        pytest.skip(f"{CONFIG} not present")


# ---------------------------------------------------------------- errors, every script

@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
def test_missing_config_argument(script):
    r = run(script, DRY_RUN="1")
    assert r.returncode == 2
    assert "missing CONFIG" in r.stderr and "usage:" in r.stderr


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
def test_config_file_not_found(script):
    r = run(script, "configs/does_not_exist.yaml", "max_steps=2", DRY_RUN="1", **SLURM_ENV)
    assert r.returncode == 2
    assert "config file not found: configs/does_not_exist.yaml" in r.stderr


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
@pytest.mark.parametrize("bad", ["max_steps", "=3", "max steps=3", "model..dtype=x", "--=3", "-max_steps=3"])
def test_bad_override(script, bad):
    r = run(script, CONFIG, "output_dir=/tmp/x", bad, DRY_RUN="1", **SLURM_ENV)
    assert r.returncode == 2
    assert f"bad override '{bad}': expected key=value" in r.stderr


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
def test_override_given_in_place_of_config(script):
    r = run(script, "max_steps=2", DRY_RUN="1", **SLURM_ENV)
    assert r.returncode == 2
    assert "the first argument must be the CONFIG file" in r.stderr


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
def test_bad_nproc(script):
    r = run(script, CONFIG, DRY_RUN="1", NPROC_PER_NODE="two", **SLURM_ENV)
    assert r.returncode == 2
    assert "NPROC_PER_NODE must be a positive integer" in r.stderr


@pytest.mark.parametrize("script", SBATCH_SCRIPTS)
def test_sbatch_script_outside_slurm(script):
    r = run(script, CONFIG)
    assert r.returncode == 2
    assert "not inside a SLURM job: submit this script with sbatch" in r.stderr


def test_torchrun_python_without_torch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    r = run(TORCHRUN, CONFIG, DRY_RUN="1", PYTHON=str(fake))
    assert r.returncode == 2
    assert "could not import torch" in r.stderr


def test_torchrun_multinode_needs_master_addr():
    r = run(TORCHRUN, CONFIG, DRY_RUN="1", NPROC_PER_NODE="2", NNODES="2")
    assert r.returncode == 2
    assert "needs MASTER_ADDR" in r.stderr


def test_torchrun_help():
    r = run(TORCHRUN, "--help")
    assert r.returncode == 0
    assert "launch/torchrun.sh CONFIG [key=value ...]" in r.stdout
    assert "NPROC_PER_NODE" in r.stdout


# ---------------------------------------------------------------- the commands they build

def test_torchrun_single_node_command():
    cmd = dry_run(TORCHRUN, CONFIG, "output_dir=/tmp/o", "model.dtype=bfloat16", NPROC_PER_NODE="2")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd
    assert cmd[cmd.index("-m", 3):] == ["-m", "grpo_dist.train", "--config", CONFIG,
                                        "output_dir=/tmp/o", "model.dtype=bfloat16"]


def test_torchrun_counts_gpus_and_falls_back_to_cpu():
    # no NPROC_PER_NODE: the script asks torch; this machine has no GPU -> 1 CPU process
    import torch
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 1
    cmd = dry_run(TORCHRUN, CONFIG)
    assert f"--nproc_per_node={expected}" in cmd


def test_torchrun_multinode_command():
    cmd = dry_run(TORCHRUN, CONFIG, NPROC_PER_NODE="8", NNODES="3", MASTER_ADDR="head", MASTER_PORT="1234")
    assert "--nnodes=3" in cmd and "--rdzv_backend=c10d" in cmd
    assert "--rdzv_endpoint=head:1234" in cmd and "--standalone" not in cmd


def test_override_values_may_contain_spaces_and_equals():
    cmd = dry_run(TORCHRUN, CONFIG, "run_name=a b=c", NPROC_PER_NODE="1")
    assert cmd[-1] == "run_name=a b=c"


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS])
def test_argparse_style_flags_pass_through(script):
    flags = ["--learning_rate", "1e-6", "--model.dtype=bfloat16", "--bf16", "--data.system_prompt", "a=b c",
             "max_steps=2"]
    cmd = dry_run(script, CONFIG, *flags, NPROC_PER_NODE="1", **SLURM_ENV)
    assert cmd[-len(flags):] == flags


def test_multinode_sbatch_command():
    cmd = dry_run(MULTI_NODE, CONFIG, "output_dir=/scratch/run", "max_steps=2", NPROC_PER_NODE="8", **SLURM_ENV)
    assert cmd[0] == "srun"
    assert "--ntasks-per-node=1" in cmd and "--nodes=2" in cmd and "--kill-on-bad-exit=1" in cmd
    i = cmd.index(sys.executable)
    assert cmd[i + 1:i + 3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in cmd and "--nproc_per_node=8" in cmd
    assert "--rdzv_backend=c10d" in cmd
    assert f"--rdzv_endpoint=gpu07:{20000 + 4242}" in cmd  # first node of gpu[07-08]
    assert "--rdzv_id=4242" in cmd
    # resume is automatic, and the user's overrides come after it (later ones win)
    assert cmd[cmd.index("grpo_dist.train") + 1:] == ["--config", CONFIG, "resume_from_checkpoint=auto",
                                                      "output_dir=/scratch/run", "max_steps=2"]


def test_one_node_sbatch_command():
    cmd = dry_run(ONE_NODE, CONFIG, "resume_from_checkpoint=null", NPROC_PER_NODE="4")
    assert cmd[0] == "srun" and "--standalone" in cmd and "--nproc_per_node=4" in cmd
    assert cmd[-2:] == ["resume_from_checkpoint=auto", "resume_from_checkpoint=null"]


def test_rdzv_port_override():
    cmd = dry_run(MULTI_NODE, CONFIG, NPROC_PER_NODE="1", RDZV_PORT="29400", **SLURM_ENV)
    assert "--rdzv_endpoint=gpu07:29400" in cmd


def test_python_from_path_when_unset(tmp_path):
    # the job uses the `python` of the environment that was active at sbatch time
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(SLURM_ENV, DRY_RUN="1", NPROC_PER_NODE="1", PATH=f"{tmp_path}:{os.environ['PATH']}")
    r = subprocess.run(["bash", MULTI_NODE, CONFIG], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[shlex.split(r.stdout).index("--kill-on-bad-exit=1") + 1] == str(fake)


# ---------------------------------------------------------------- the #SBATCH headers

def sbatch_options(script: str) -> dict[str, str]:
    opts = {}
    for line in (REPO / script).read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            opts[m.group(1)] = m.group(2) or ""
    return opts


@pytest.mark.parametrize("script", SBATCH_SCRIPTS)
def test_sbatch_headers(script):
    opts = sbatch_options(script)
    assert opts["ntasks-per-node"] == "1"
    assert opts["gpus-per-node"] == "8"
    assert re.fullmatch(r"B:USR1@\d+", opts["signal"])
    assert "requeue" in opts and opts["open-mode"] == "append"
    assert "%j" in opts["output"]
    assert opts["nodes"] == ("1" if script == ONE_NODE else "2")
    # the cluster-specific ones are there for the user to switch on
    text = (REPO / script).read_text()
    assert "##SBATCH --partition=" in text and "##SBATCH --account=" in text
    # SLURM stops reading #SBATCH lines at the first command
    first_cmd = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    last_sbatch = max(i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert last_sbatch < first_cmd


@pytest.mark.parametrize("script", [TORCHRUN, *SBATCH_SCRIPTS, ENTRYPOINT])
def test_no_paths_of_ours(script):
    code = [line for line in (REPO / script).read_text().splitlines() if not line.lstrip().startswith("#")]
    for needle in ("/work/", ".venv", "/home/", "/tmp/"):
        assert not [line for line in code if needle in line], f"{script} mentions {needle}"


# ---------------------------------------------------------------- docker entrypoint

def test_entrypoint_passes_config_to_torchrun():
    cmd = dry_run(ENTRYPOINT, CONFIG, "output_dir=/output/x", NPROC_PER_NODE="2",
                  GRPO_DIST_LAUNCH=str(REPO / TORCHRUN))
    assert cmd[cmd.index("grpo_dist.train") + 1:] == ["--config", CONFIG, "output_dir=/output/x"]


def test_entrypoint_runs_other_commands():
    r = run(ENTRYPOINT, "echo", "hello", GRPO_DIST_LAUNCH=str(REPO / TORCHRUN))
    assert r.returncode == 0 and r.stdout.strip() == "hello"


def test_entrypoint_missing_config():
    r = run(ENTRYPOINT, "configs/nope.yaml", GRPO_DIST_LAUNCH=str(REPO / TORCHRUN))
    assert r.returncode == 2 and "config file not found" in r.stderr


# ---------------------------------------------------------------- the scripts themselves

@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck():
    r = subprocess.run(["shellcheck", "-x", *ALL_SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- exit codes through torchrun

@pytest.mark.slow
@pytest.mark.parametrize("args,env,code", [
    (["rewards=[{function: 'grpo_dist.rewards:no_such_reward'}]"], {}, 2),          # bad config: 2, not 1
    (["max_consecutive_nonfinite=1"], {"GRPO_DIST_FAULT": "nan@step1"}, 3),          # non-finite: 3, not 1
])
def test_torchrun_sh_passes_the_workers_exit_code(tmp_path, args, env, code):
    """Plain torchrun exits 1 whenever a worker fails; launch/torchrun.sh returns the workers' own code."""
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    r = run(TORCHRUN, CONFIG, f"output_dir={tmp_path / 'run'}", "max_steps=2", "reward_workers=0",
            "progress_bar=false", *args, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **env)
    assert r.returncode == code, r.stderr[-3000:]


@pytest.mark.slow  # 2 ranks of the smoke config until step 2, then a Ctrl-C: ~20 s
def test_ctrl_c_at_launch_torchrun_sh_checkpoints_exits_75_and_the_trainers_line_is_last(tmp_path):
    """A terminal's Ctrl-C goes to the launcher's whole process group. torchrun used to be in it and get the SIGINT
    twice (from the terminal and from the launcher's trap), take the second for a second Ctrl-C and SIGTERM the
    workers: they aborted with no checkpoint and torchrun's traceback came last. Now: one stop, the checkpoint of the
    step, exit 75, and the trainer's line is the last one on the screen."""
    import signal
    import time
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC", "NNODES", "MASTER_"))}
    env.update(PYTHON=sys.executable, NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "screen.txt"
    with open(log, "w") as screen:
        p = subprocess.Popen(["bash", TORCHRUN, CONFIG, f"output_dir={out}", "max_steps=500", "reward_workers=0",
                              "progress_bar=false", "save_steps=0"], cwd=REPO, env=env, stdout=screen,
                             stderr=subprocess.STDOUT, start_new_session=True)  # its own group, as a terminal's job
        try:
            deadline = time.monotonic() + 240
            while not (out / "metrics.jsonl").is_file() or (out / "metrics.jsonl").read_text().count("\n") < 2:
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C
            code = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    screen_text = log.read_text()
    assert code == 75, screen_text[-3000:]
    assert len(list(out.glob("checkpoint-*"))) == 1, screen_text[-3000:]
    assert "Traceback" not in screen_text and "SIGTERM): aborting" not in screen_text, screen_text[-3000:]
    last = [ln for ln in screen_text.splitlines() if ln.strip()][-1]
    assert last.startswith("[grpo_dist] stop requested: checkpoint written at step ") and \
        last.endswith("exiting with code 75"), screen_text[-3000:]

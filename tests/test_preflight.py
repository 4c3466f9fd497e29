"""Every mistake named before anything heavy starts: exit code 2 and one line naming the key, file or path; one run
per output_dir; a failed save names the last good checkpoint; checkpoint files readable like the others."""

import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}")
COMMON = ["--config", "configs/smoke_cpu.yaml", "max_steps=1", "save_steps=0", "reward_workers=0",
          "progress_bar=false"]


def _train(*extra, env=None):
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), e.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", *COMMON, *extra], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    return r.returncode, lines


@pytest.mark.parametrize("case", ["reward_typo", "missing_model", "offline_hub", "output_file", "resume_missing",
                                  "non_utf8"])
def test_mistakes_exit_2_with_one_line(tmp_path, case):
    out = f"output_dir={tmp_path / 'run'}"
    env = None
    if case == "reward_typo":
        args, expect = ["rewards=[{function: 'grpo_dist.rewards:math_rewad'}]"], "rewards[0].function"
    elif case == "missing_model":
        args, expect = [f"model.name_or_path={tmp_path}/no/such/model"], "'model.name_or_path'"
    elif case == "offline_hub":
        args, expect = ["model.name_or_path=nobody-here/no-such-model-xyz"], "not in the Hugging Face cache"
        env = {"HF_HUB_OFFLINE": "1"}
    elif case == "output_file":
        (tmp_path / "f").write_text("x")
        out, args, expect = f"output_dir={tmp_path / 'f'}", [], "is a file, not a directory"
    elif case == "resume_missing":
        args, expect = [f"resume_from_checkpoint={tmp_path}/nope"], "'resume_from_checkpoint'"
    else:
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9", "answer": "3"}\n')
        args, expect = ["data.preset=null", f"data.path={bad}"], f"{bad}:2: not UTF-8"
    code, lines = _train(out, *args, env=env)
    assert code == 2, lines
    assert len(lines) == 1 and expect in lines[0], lines
    assert "Traceback" not in lines[0]


def test_output_dir_unwritable_named(tmp_path, monkeypatch):
    """(Root ignores directory modes, so the read-only filesystem is simulated.)"""
    from grpo_dist import preflight
    from grpo_dist.config import ConfigError

    def refuse(self, data):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(ConfigError, match=r"'output_dir' = .* is not writable: Read-only file system"):
        preflight.check_output_dir(str(tmp_path / "run"))


def test_output_dir_lock(tmp_path):
    """A live holder refuses a second run naming it; a lock left by a dead process is taken over with a note; the
    lock is released (and emptied) at the end."""
    from grpo_dist.runlock import LOCK_NAME, OutputDirInUse, OutputDirLock
    held = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    os.write(held, json.dumps({"pid": 4242, "host": "nodeA", "since": "then"}).encode())
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    code, lines = _train(f"output_dir={tmp_path}")
    assert code == 2 and len(lines) == 1 and "in use by another grpo_dist run (pid 4242 on host nodeA" in lines[0]
    with pytest.raises(OutputDirInUse):
        OutputDirLock(tmp_path).acquire()
    os.close(held)  # the holder dies: the kernel drops its flock, its record stays in the file
    lock = OutputDirLock(tmp_path)
    note = lock.acquire()
    assert "pid 4242 on host nodeA" in note and "stale" in note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""


def test_fresh_run_in_used_output_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoint-1").mkdir()
    code, lines = _train(f"output_dir={tmp_path}")
    assert code == 2 and len(lines) == 1 and "already holds a run (checkpoint-1, metrics.jsonl)" in lines[0]
    code, lines = _train(f"output_dir={tmp_path}", "overwrite_output_dir=true")
    assert code == 0, lines
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1  # the old line is gone
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").is_file()  # the new run's own checkpoint-1


def _trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, [TINY, "data.limit=8", "prompts_per_rank=2", "num_generations=2",
                             "max_completion_length=4", "reward_workers=0", "beta=0", "progress_bar=false",
                             "report_to=[]", "save_format=full"] + overrides)
    return GRPOTrainer(cfg, init_distributed(60))


def test_full_disk_names_last_good_checkpoint_and_modes(tmp_path, monkeypatch, one_thread):
    import torch

    from grpo_dist.checkpoint import CheckpointError, verify_checkpoint
    tr = _trainer([f"output_dir={tmp_path}"])
    old = os.umask(0o022)
    try:
        tr.train_step()
        first = tr.save()
    finally:
        os.umask(old)
    # every file of the checkpoint follows the umask (safetensors alone used to write 0600)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in first.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644 and modes["config.json"] == 0o644, modes
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    tr.train_step()
    with pytest.raises(CheckpointError) as err:
        tr.save()
    msg = str(err.value)
    assert "No space left on device" in msg and f"the last good checkpoint is {first}" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert verify_checkpoint(first, check_hashes=True) is None


def test_resume_checkpoint_of_another_shape(tmp_path, one_thread):
    from grpo_dist.checkpoint import CheckpointError
    tr = _trainer([f"output_dir={tmp_path / 'a'}"])
    tr.train_step()
    ck = tr.save()
    bigger = TINY.replace("hidden_size: 32", "hidden_size: 64")
    with pytest.raises(CheckpointError, match=r"another model \(hidden_size = 32 there, 64 in this run"):
        _trainer([bigger, f"output_dir={tmp_path / 'b'}", f"resume_from_checkpoint={ck}"])


def test_huge_prompt_rows_cut_before_tokenizing(capsys):
    from grpo_dist.data import CHARS_PER_TOKEN_BOUND, PromptExample, truncate_long_prompts
    rows = [PromptExample("x" * 10_000_000 + "tail", "1", 0), PromptExample("short", "2", 1),
            PromptExample("y" * 9000, "3", 2)]
    out = truncate_long_prompts(rows, 512, "train.jsonl")
    limit = 512 * CHARS_PER_TOKEN_BOUND
    assert [len(e.prompt) for e in out] == [limit, 5, limit]
    assert out[0].prompt.endswith("tail") and out[1] is rows[1]  # kept from the right, like the token truncation
    warn = capsys.readouterr().out
    assert warn.count("warning") == 1 and "train.jsonl: 2 of 3 prompts are longer than" in warn


@pytest.mark.fast
def test_half_precision_on_a_cpu_warns_once_when_measured_slow():
    """bf16 / fp16 on a CPU without 16-bit matrix units is emulated: the start-up note names each dtype asked for
    (model.dtype or mixed_precision) with its measured slowdown against float32, and says nothing when it is not
    slow, when only float32 is asked for, or on a GPU. The timer is injected: what is checked is the rule."""
    import torch

    from grpo_dist.config import load_config
    from grpo_dist.preflight import cpu_half_precision_note
    cpu = torch.device("cpu")
    calls = []

    def timer(ratios):
        def seconds(dtype):
            calls.append(dtype)
            return {torch.float32: 1.0, torch.bfloat16: ratios[0], torch.float16: ratios[1]}[dtype]
        return seconds

    bf16 = load_config(None, ["model.dtype=bfloat16"])
    note = cpu_half_precision_note(bf16, cpu, timer((3.0, 1.0)))
    assert note is not None and "bfloat16 3.0x" in note and "float16" not in note.replace("bfloat16", "")
    assert "model.dtype=float32" in note
    assert cpu_half_precision_note(bf16, cpu, timer((1.9, 1.0))) is None  # under the 2x limit
    assert cpu_half_precision_note(bf16, torch.device("meta"), timer((9.0, 9.0))) is None  # not a CPU
    mixed = load_config(None, ["distributed.mixed_precision=fp16"])
    assert "float16 5.0x" in cpu_half_precision_note(mixed, cpu, timer((9.0, 5.0)))
    calls.clear()
    assert cpu_half_precision_note(load_config(None, []), cpu, timer((9.0, 9.0))) is None
    assert calls == []  # float32 only: nothing is timed
    ratio = cpu_half_precision_note(bf16, cpu, limit=0.0)  # the real timer: runs, and names a finite ratio
    assert ratio is not None and "bfloat16" in ratio

"""Resume never trusts a damaged checkpoint, and what the user changes on resume is applied.

On 2 gloo ranks: a checkpoint whose model.safetensors was corrupted without changing its size is refused when named
(every rank raises, naming the file), and auto-resume falls back to the previous intact checkpoint. A learning rate
(and the other AdamW settings) changed on resume reach the optimizer's param groups and the LR schedule."""

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.slow  # 2-rank spawns: ~50 s each on a busy 2-core box

BASE = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}",
        "data.limit=8", "prompts_per_rank=2", "num_generations=4", "max_completion_length=8",
        "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0", "learning_rate=1e-3",
        "beta=0", "micro_batch_size=4", "max_steps=4", "save_format=full", "progress_bar=false",
        "report_to=[jsonl]", "distributed.timeout_s=60"]


def _trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _two_checkpoints(rank, world, out):
    tr = _trainer([f"output_dir={out}"])
    for _ in range(2):
        tr.train_step()
        tr.save()


def _corrupt(path):
    """Flip one byte in the middle of the file: same size, so only the checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _resume(rank, world, out, value, extra):
    try:
        tr = _trainer([f"output_dir={out}", f"resume_from_checkpoint={value}"] + extra)
    except Exception as e:  # noqa: BLE001 - CheckpointError expected; anything else fails the assertions
        return "error", f"{type(e).__name__}: {e}"
    return "resumed", tr.step


def _resume_lr(rank, world, out, value, extra):
    tr = _trainer([f"output_dir={out}", f"resume_from_checkpoint={value}"] + extra)
    opt, sched = tr.engine.optimizer, tr.engine.scheduler
    return ([dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])
             for g in opt.param_groups], list(sched.base_lrs), tr.step)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "run"
    run_ranks(_two_checkpoints, 2, out.parent, str(out))
    return out


def test_corrupted_checkpoint_refused_and_auto_falls_back(ckpt_dir, tmp_path, capfd):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(ckpt_dir, out)
    _corrupt(out / "checkpoint-2" / "model.safetensors")
    named = run_ranks(_resume, 2, tmp_path, str(out), str(out / "checkpoint-2"), [])
    for kind, msg in named:  # every rank refuses, naming the file
        assert kind == "error" and msg.startswith("CheckpointError") and \
            "model.safetensors has the wrong checksum" in msg, msg
    auto = run_ranks(_resume, 2, tmp_path, str(out), "auto", [])
    assert auto == [("resumed", 1), ("resumed", 1)]
    # the fallback is announced, naming the bad file, and the damaged checkpoint is moved aside, not deleted
    err = capfd.readouterr().err
    assert "checkpoint-2: model.safetensors has the wrong checksum" in err
    assert f"moved it to {out}/damaged/checkpoint-2" in err and not (out / "checkpoint-2").exists()
    # with the check turned off the damage goes unnoticed: the key really switches the verification
    shutil.move(out / "damaged" / "checkpoint-2", out / "checkpoint-2")
    off = run_ranks(_resume, 2, tmp_path, str(out), "auto", ["verify_checkpoint_hashes=false"])
    assert off == [("resumed", 2), ("resumed", 2)]


def test_changed_optimizer_settings_win_on_resume(ckpt_dir, tmp_path):
    """Constant schedule: the LR after resume is the configured one, not the checkpoint's 1e-3; with warmup the
    schedule multiplies the new base LR (step 2 of 4 warmup steps: 3/4 of it)."""
    ck = str(ckpt_dir / "checkpoint-2")
    new = ["learning_rate=2e-4", "adam_beta1=0.8", "adam_beta2=0.99", "adam_epsilon=1e-6", "weight_decay=0.1"]
    groups, base_lrs, step = run_ranks(_resume_lr, 2, tmp_path, str(tmp_path / "a"), ck, new)[0]
    assert step == 2
    assert base_lrs == [pytest.approx(2e-4)] * len(base_lrs)
    for g in groups:
        assert g == dict(lr=pytest.approx(2e-4), betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    groups, base_lrs, _ = run_ranks(_resume_lr, 2, tmp_path, str(tmp_path / "b"), ck,
                                    ["learning_rate=2e-4", "warmup_steps=4"])[0]
    # LambdaLR has taken 2 steps: the LR of optimizer step index 2 is (2 + 1) / 4 of the base
    assert [g["lr"] for g in groups] == [pytest.approx(2e-4 * 3 / 4)] * len(groups)

"""Helpers shared by several test modules (test modules import from here, never from each other)."""

import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# ------------------------------------------------------------------ the fixed one-step batch (2 ranks vs 1 process)

G = 4
PROMPTS = 4          # in total; each of 2 ranks takes 2
VOCAB_LO, VOCAB_HI = 4, 100  # ordinary (non-special) token ids of the char tokenizer

EQUIV_BASE = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
              "num_key_value_heads: 2, intermediate_size: 64}",
              f"num_generations={G}", "max_completion_length=10", "learning_rate=1e-3", "adam_epsilon=1e-6",
              "reward_workers=0", "beta=0.04", "max_grad_norm=1.0", "progress_bar=false", "report_to=[]",
              "temperature=0.9"]


def fixed_rollout(pad_id=0, eos_id=1):
    """A deterministic batch with uneven prompt and completion lengths, some ending in EOS, some truncated."""
    from grpo_dist.rollout import RolloutBatch
    g = torch.Generator().manual_seed(123)
    n, P, C = PROMPTS * G, 7, 10
    prompt_ids = torch.full((n, P), pad_id)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    completion_ids = torch.full((n, C), pad_id)
    completion_mask = torch.zeros(n, C, dtype=torch.long)
    for p in range(PROMPTS):
        plen = int(torch.randint(2, P + 1, (1,), generator=g))
        prompt = torch.randint(VOCAB_LO, VOCAB_HI, (plen,), generator=g)
        for j in range(G):
            i = p * G + j
            prompt_ids[i, P - plen:] = prompt
            prompt_mask[i, P - plen:] = 1
            clen = int(torch.randint(1, C + 1, (1,), generator=g))
            completion_ids[i, :clen] = torch.randint(VOCAB_LO, VOCAB_HI, (clen,), generator=g)
            if clen < C or j % 2:  # most end with EOS (included in the mask); some are truncated
                completion_ids[i, clen - 1] = eos_id
            completion_mask[i, :clen] = 1
    rewards = torch.tensor([1., 0, 1, 0,   1, 1, 1, 1,   0, 0, 1, 0,   0.5, 1, 0, 0.25])  # group 2 is flat
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, G), rewards


# ------------------------------------------------------------------------- the tiny trainer of the resume tests

# 8 prompts, 2 ranks x 2 prompts per step: 2 steps per epoch, so checkpoint-2 sits exactly on an epoch boundary.
RESUME_BASE = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
               "num_key_value_heads: 2, intermediate_size: 64}",
               "data.limit=8", "prompts_per_rank=2", "num_generations=4", "max_completion_length=8",
               "temperature=1.0", "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0",
               "learning_rate=1e-3", "weight_decay=0.0", "warmup_steps=2", "lr_scheduler_type=cosine", "beta=0.04",
               "num_iterations=2", "micro_batch_size=4", "max_steps=4", "save_format=full", "progress_bar=false",
               "report_to=[jsonl]", "distributed.timeout_s=60"]


def resume_trainer(overrides):
    """A GRPOTrainer on RESUME_BASE + overrides, in an initialised process group (one per rank under run_ranks)."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, RESUME_BASE + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def no_dense_optimizer_state(trainer):
    """adamw_8bit: the optimizer's state_dict() (torch's machinery: fp32 moments and per-element scales, 16 bytes
    per parameter) fails from here on, so that saves and resumes are seen to move its quantised state only
    (grpo_dist/optim8bit.py). Returns the trainer."""
    def refused():
        raise AssertionError("adamw_8bit's state_dict() was called: the dense 16-byte layout was built")
    trainer.engine.optimizer.state_dict = refused
    return trainer


# ----------------------------------------------------------------------------------------------------- asserts

def tensors_equal(a, b, where=""):
    """Recursive bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max diff {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ"
        for k in a:
            tensors_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# A tiny Llama whose output layer is tied to its embeddings (test_tied_embeddings, test_deepspeed_reference).
TIED_BASE = ["model.tiny={architecture: llama, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
              "num_key_value_heads: 2, intermediate_size: 64, tie_word_embeddings: true}",
              "data.limit=8", "prompts_per_rank=2", "num_generations=4", "max_completion_length=8", "temperature=1.0",
              "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0",
              "learning_rate=1e-3", "weight_decay=0.0", "beta=0.04", "micro_batch_size=4", "max_steps=2",
              "save_format=full", "progress_bar=false", "report_to=[jsonl]", "distributed.timeout_s=60"]


def checkpoint_state(ckpt):
    """(weights, optimizer state, trainer state without config/save_format) of a full-state checkpoint."""
    from safetensors.torch import load_file
    trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
    for k in ("config", "save_format"):
        trainer_state.pop(k)
    return (load_file(str(ckpt / "model.safetensors")), torch.load(ckpt / "optimizer.pt", weights_only=False),
            trainer_state)


# ------------------------------------------------------------------------------------------------- deepspeed

def need_deepspeed():
    """Skip without deepspeed; else JIT-build its CPU comm op here (cached in TORCH_EXTENSIONS_DIR, minutes when
    cold), so that the ranks do not spend their launch timeout compiling it."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load()


# ------------------------------------------------------------------------------------------- reward models

def save_classifier(path, num_labels=1, chat_template=None, seed=0):
    """A tiny random LlamaForSequenceClassification and the char tokenizer, saved to `path`."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_dist.models import char_tokenizer
    tok = char_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, num_labels=num_labels,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=256)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------------ LoRA

def set_lora_b(trainer, scale=0.05):
    """B starts at 0 (the adapted model equals the base); give it seeded values, the same on every rank and under
    any sharding, so that the step moves A too and the KL to the reference is not 0."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from grpo_dist.engines import clean_name
    m = trainer.engine.module
    full = FSDP.summon_full_params(m, writeback=True) if isinstance(m, FSDP) else contextlib.nullcontext()
    from torch.distributed.tensor import DTensor, distribute_tensor
    with full, torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name:
                g = torch.Generator().manual_seed(sum(map(ord, clean_name(name))))
                value = torch.randn(p.shape, generator=g) * scale
                if isinstance(p, DTensor):  # FSDP2: this rank's shard of the full value
                    value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements)
                p.copy_(value)


def in_process(fn):
    """fn() in the pytest process, with the process group and its environment variables gone afterwards (a later
    subprocess then reuses no port)."""
    from grpo_dist.distributed import cleanup
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    try:
        return fn()
    finally:
        cleanup()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def async_rank(overrides, out_dir):
    """One rank of an asynchronous run (rollout_ranks > 0) or a colocated one: (trainer, None) on a trainer rank,
    (None, serve's exit code) on a rollout rank once it has served. Call inside a spawned rank."""
    from grpo_dist.async_rollout import serve, setup
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, overrides + [f"output_dir={out_dir}"])
    ctx = init_distributed(cfg.distributed.timeout_s)
    if cfg.rollout_ranks:
        roles, ctx = setup(cfg, ctx)
        if not roles.is_trainer:
            return None, serve(cfg, roles, ctx)
    return GRPOTrainer(cfg, ctx), None


# ---------------------------------------------------------- a real full disk: a small tmpfs (root only; CI is root)
@contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                           text=True)
        problem = (r.stderr or r.stdout).strip() if r.returncode else None
    except OSError as e:  # no mount command at all
        problem = str(e)
    if problem is not None:
        why = f"cannot mount a tmpfs: {problem}"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI runs as root and must run the full-disk tests)")
        pytest.skip(f"{why} (needs root; CI runs these)")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


def fill(where: Path, leave: int) -> Path:
    """A file taking all the free space of where's filesystem but `leave` bytes."""
    filler = where / "filler"
    n = shutil.disk_usage(where).free - leave
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, n)
    return filler


def flip(path) -> None:
    """Invert one byte in the middle of a file: same size, so only the checksum can tell (a damaged checkpoint)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))

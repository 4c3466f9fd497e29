"""LoRA (lora.r > 0): one step equals the step written out here on a plain model carrying the adapter weights;
2 FSDP ranks equal 1 process; the reference is the policy without adapters; the generation copy holds merged
weights; checkpoints load with peft and resume bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import G, PROMPTS, fixed_rollout
from helpers import set_lora_b as _set_lora_b

LORA = ["lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj, v_proj, down_proj]"]
S = 8 / 4  # alpha / r


def _trainer(world_size, overrides, micro_batch_size=64):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + LORA + overrides + [f"prompts_per_rank={PROMPTS // world_size}",
                                                       f"micro_batch_size={micro_batch_size}",
                                                       "output_dir=/tmp/unused"])
    return GRPOTrainer(cfg, init_distributed(120))


def _adapters(sd):
    return {k: v.clone() for k, v in sd.items() if ".lora_" in k}


# ------------------------------------------------------------------------------------------- the step by hand
class HandLoRALinear(torch.nn.Module):
    """y = x W^T + b + S * (x A^T) B^T, written here without peft."""

    def __init__(self, linear, a, b):
        super().__init__()
        self.weight, self.bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        self.a, self.b = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
        self.on = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y + S * F.linear(F.linear(x, self.a), self.b) if self.on else y


def _hand_step(model, adapters, batch, rewards, beta=0.04, temp=0.9, lr=1e-3, eps=1e-6, b1=0.9, b2=0.999):
    from grpo_dist.advantages import group_advantages
    hand = {}
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if f"{full}.lora_A.default.weight" in adapters:
                h = HandLoRALinear(child, adapters[f"{full}.lora_A.default.weight"],
                                   adapters[f"{full}.lora_B.default.weight"])
                setattr(mod, child_name, h)
                hand[full] = h

    def logps(i):
        P, n = int(batch.prompt_mask[i].sum()), int(batch.completion_mask[i].sum())
        ids = torch.cat([batch.prompt_ids[i, -P:], batch.completion_ids[i, :n]])[None]
        logits = model(input_ids=ids).logits[0, P - 1:P - 1 + n] / temp
        return torch.log_softmax(logits, -1).gather(-1, ids[0, P:, None]).squeeze(-1)

    adv = group_advantages(rewards, G)
    total, tokens = 0.0, int(batch.completion_mask.sum())
    for i in range(len(batch)):
        for h in hand.values():
            h.on = False
        with torch.no_grad():
            ref = logps(i)
        for h in hand.values():
            h.on = True
        lp = logps(i)
        d = ref - lp
        kl = torch.exp(d) - d - 1
        total = total + (-torch.exp(lp - lp.detach()) * adv[i] + beta * kl).sum()
    loss = total / tokens
    params = [p for h in hand.values() for p in (h.a, h.b)]
    grads = torch.autograd.grad(loss, params)

    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    clip = min(1.0, 1.0 / (float(norm) + 1e-6))  # max_grad_norm = 1
    out = {}
    for (full, h), ga, gb in zip(hand.items(), grads[0::2], grads[1::2]):
        for key, p, g in ((f"{full}.lora_A.default.weight", h.a, ga), (f"{full}.lora_B.default.weight", h.b, gb)):
            g = g * clip
            m, v = (1 - b1) * g, (1 - b2) * g * g   # AdamW's first step, weight decay 0
            out[key] = p.detach() - lr * (m / (1 - b1)) / (torch.sqrt(v / (1 - b2)) + eps)
    return out, float(loss)


def _lora_step(rank, world_size, micro_batch_size, hand):
    from grpo_dist.distributed import init_distributed
    init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    trainer = _trainer(world_size, [], micro_batch_size)
    assert trainer.ref_model is not None and not any(True for _ in trainer.ref_model.parameters())  # no 2nd model
    _set_lora_b(trainer)
    before, expected = None, None
    if hand:  # one process (local engine: a plain module). Not gather_full_state: before the first step it
        # initialises the optimizer state (torch's get_state_dict), which shifts Adam's bias correction
        before = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
        from grpo_dist.models import load_model
        plain = load_model(trainer.cfg.model, trainer.tokenizer)
        expected = _hand_step(plain, _adapters(before), batch, rewards)
    grad_sizes = _record_gradient_sizes(trainer)
    metrics = trainer.learn(batch.rows(rows), rewards[rows])
    after, optim = trainer.engine.gather_full_state()
    trainer.engine.copy_weights_to(trainer.gen_model)
    if rank:
        return None
    trainable = [k for k in optim["state"]] if optim else []
    return dict(before=before, after=after, metrics=metrics, expected=expected, trainable=trainable, grads=grad_sizes,
                gen={k: v.clone() for k, v in trainer.gen_model.state_dict().items()})


def _record_gradient_sizes(trainer):
    """Before the optimizer step: (gradient elements held, of which adapter gradients), counted on FSDP's flat
    parameters when the policy is FSDP-wrapped (what the memory holds), else on the parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    seen = []
    step = trainer.engine.step

    def recording_step(skip=False):
        m = trainer.engine.module
        adapter = sum(p.grad.numel() for n, p in m.named_parameters() if p.grad is not None and ".lora_" in n)
        if isinstance(m, FSDP):
            flats = [u._handle.flat_param for u in FSDP.fsdp_modules(m) if u._handle is not None]
            held = sum(f.grad.numel() for f in flats if f.grad is not None)
        else:
            held = sum(p.grad.numel() for p in m.parameters() if p.grad is not None)
        seen.append((held, adapter))
        return step(skip)
    trainer.engine.step = recording_step
    return seen


@pytest.mark.slow
def test_lora_step_equals_the_step_by_hand_and_two_ranks_equal_one(tmp_path):
    one = run_ranks(_lora_step, 1, tmp_path, 64, True)[0]
    (expected, hand_loss) = one["expected"]
    assert abs(one["metrics"]["loss"] - hand_loss) < 1e-5
    assert one["metrics"]["kl"] > 1e-6  # the reference (adapters off) differs from the policy
    for k, v in expected.items():
        assert torch.allclose(one["after"][k], v, atol=1e-6), k
        assert not torch.equal(one["before"][k], one["after"][k]), k
    # only adapters are trained: every other tensor is unchanged, the optimizer holds adapter state only
    for k in one["before"]:
        if ".lora_" not in k:
            assert torch.equal(one["before"][k], one["after"][k]), k
    assert one["trainable"] and all(".lora_" in k for k in one["trainable"])
    # the generation copy holds W + S * B A
    for k, w in one["gen"].items():
        base = k.replace(".weight", ".base_layer.weight")
        if base in one["after"]:
            a, b = one["after"][base.replace("base_layer", "lora_A.default")], \
                one["after"][base.replace("base_layer", "lora_B.default")]
            assert torch.allclose(w, one["after"][base] + S * b @ a, atol=1e-6), k
        elif k in one["after"]:
            assert torch.equal(w, one["after"][k]), k
    two = run_ranks(_lora_step, 2, tmp_path, 3, False)[0]
    # FSDP holds gradients for the adapters only (not for the frozen base weights sharing a unit with them)
    (held, adapter), = two["grads"]
    assert adapter > 0 and held == adapter, (held, adapter)
    for k in expected:
        assert torch.allclose(two["after"][k], one["after"][k], atol=1e-6), k
    assert abs(two["metrics"]["loss"] - one["metrics"]["loss"]) < 1e-6


# ------------------------------------------------------------------------------------------------- checkpoints
from helpers import RESUME_BASE  # noqa: E402


def _resume_trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, RESUME_BASE + LORA + ["lora.save_merged=true", "max_steps=3"] + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _straight(rank, world, out):
    tr = _resume_trainer([f"output_dir={out}", "save_steps=1"])
    assert tr.train() == 0


def _resumed(rank, world, path, out):
    tr = _resume_trainer([f"output_dir={out}", f"resume_from_checkpoint={path}"])
    assert tr.step == 1
    assert tr.train() == 0


def _files_equal(a, b, names):
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.slow
def test_lora_resume_is_bitwise_and_checkpoints_load_with_peft(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_ranks(_straight, 2, tmp_path, str(straight))
    run_ranks(_resumed, 2, tmp_path, str(straight / "checkpoint-1"), str(resumed))
    a, b = straight / "checkpoint-3", resumed / "checkpoint-3"
    assert not (a / "model.safetensors").exists()  # the base weights are the model's own: not copied
    _files_equal(a, b, ["adapter_model.safetensors", "adapter_config.json", "merged/model.safetensors"])
    oa, ob = torch.load(a / "optimizer.pt", weights_only=False), torch.load(b / "optimizer.pt", weights_only=False)
    for k in oa["state"]:
        for name, t in oa["state"][k].items():
            assert torch.equal(t, ob["state"][k][name]), (k, name)
    # peft loads the adapter onto the base model; its output equals the merged model in merged/
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, RESUME_BASE)
    base = load_model(cfg.model, load_tokenizer(cfg.model))
    ids = torch.randint(4, 90, (2, 12))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(base, str(a)).eval()
        adapted = peft_model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(a / "merged")).eval()(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-4  # the adapter learned something
    assert torch.allclose(adapted, merged, atol=1e-5)


# ------------------------------------------------------------------------------------------------ real model
def _real_lora_step(rank, world_size, model_dir):
    """One LoRA step of SmolLM2 on fixed rollouts; on 2 ranks rank 1 builds on the meta device and gets rank 0's
    weights and adapters by broadcast."""
    from grpo_dist.distributed import init_distributed
    init_distributed(300)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    trainer = _trainer(world_size, [f"model.name_or_path={model_dir}", "learning_rate=1e-4"], 4)
    _set_lora_b(trainer, 0.01)
    metrics = trainer.learn(batch.rows(rows), rewards[rows])
    sd, _ = trainer.engine.gather_full_state()
    return (_adapters(sd), metrics) if rank == 0 else None


@pytest.mark.slow
@pytest.mark.real_model
def test_lora_real_model_two_ranks_equal_one(smollm2_dir, tmp_path):
    one, m1 = run_ranks(_real_lora_step, 1, tmp_path, str(smollm2_dir))[0]
    two, m2 = run_ranks(_real_lora_step, 2, tmp_path, str(smollm2_dir))[0]
    assert m1["kl"] > 0 and abs(m1["loss"] - m2["loss"]) < 1e-5 and abs(m1["kl"] - m2["kl"]) < 1e-6
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6), k


def _dropout_check(rank, world_size):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.rollout import completion_logits, sequence_inputs
    init_distributed(60)
    batch, _ = fixed_rollout()
    trainer = _trainer(1, ["lora.dropout=0.5"])
    _set_lora_b(trainer, 0.5)
    trainer.engine.copy_weights_to(trainer.gen_model)
    rows = batch.rows([0, 1])
    with torch.no_grad():
        policy = [completion_logits(trainer.engine.module, rows) for _ in range(2)]
        ref = [completion_logits(trainer.ref_model, rows) for _ in range(2)]
        gen = [trainer.gen_model(**sequence_inputs(rows)).logits for _ in range(2)]
    return not torch.equal(*policy), torch.equal(*ref), torch.equal(*gen)


def test_lora_dropout_acts_in_the_policy_only(tmp_path):
    policy_stochastic, ref_fixed, gen_fixed = run_ranks(_dropout_check, 1, tmp_path)[0]
    assert policy_stochastic and ref_fixed and gen_fixed

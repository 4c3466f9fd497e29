"""Shared prompts in the packed passes (grpo_dist/prompt_sharing.py, share_prompts): the stream holds each prompt
once, then its rows' completions; per-token log-probs, entropies, every loss and its gradient equal those of the
plain packed path (one copy of the prompt per row); the micro-batches keep a prompt's rows together; a model that
cannot run the shared attention falls back with one line, and a forward whose attention ignored the plan raises."""

import contextlib
import io

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import PROMPTS, fixed_rollout

TOL = 1e-5


def _tiny(attn="sdpa"):
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE + [f"model.attn_implementation={attn}"])
    return load_model(cfg.model, load_tokenizer(cfg.model)).float()


def test_shared_layout_holds_each_prompt_once():
    """Written out: per prompt (in order of first appearance) its real tokens at positions 0..p-1, then each of its
    rows' completion at positions p..p+c-1; a row's first token is predicted from the prompt's last position, its
    others from its own; the attention calls tile the stream, and a completion's mask reads the whole prompt and
    itself causally, never another completion (each completion one attention row after the prompt's copy)."""
    from grpo_dist.packing import pack_rows, unpack
    from grpo_dist.prompt_sharing import shared_layout
    batch, _ = fixed_rollout()
    mb = batch.rows([4, 0, 5, 1, 9])  # rows 0, 1 share prompt 0; 4, 5 prompt 1; 9 is alone (prompt 2)
    packed = pack_rows(mb, share_prompts=True)
    prompt = {i: mb.prompt_ids[i][mb.prompt_mask[i].bool()].tolist() for i in range(len(mb))}
    comp = {i: mb.completion_ids[i][mb.completion_mask[i].bool()].tolist() for i in range(len(mb))}
    ids, pos, keep = [], [], {}
    for group in ([0, 2], [1, 3], [4]):  # rows of mb: 4,5 -> mb rows 0, 2; 0,1 -> mb rows 1, 3; 9 -> mb row 4
        p0 = len(ids)
        p = len(prompt[group[0]])
        assert all(prompt[r] == prompt[group[0]] for r in group)
        ids += prompt[group[0]]
        pos += list(range(p))
        for r in group:
            start = len(ids)
            ids += comp[r]
            pos += list(range(p, p + len(comp[r])))
            keep[r] = [p0 + p - 1] + list(range(start, start + len(comp[r]) - 1))
    assert packed.input_ids.tolist() == [ids] and packed.position_ids.tolist() == [pos]
    assert packed.keep.tolist() == [k for r in range(len(mb)) for k in keep[r]]
    assert packed.labels.tolist() == [t for r in range(len(mb)) for t in comp[r]]
    # the attention rows: prompt 1 (mb rows 0, 2) then each of its completions, the first row owning the prompt
    p1, n0, n2 = len(prompt[0]), len(comp[0]), len(comp[2])
    layout = shared_layout(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask)
    assert layout.rows[:2] == [([(0, p1), (p1, p1 + n0)], 0), ([(0, p1), (p1 + n0, p1 + n0 + n2)], p1)]
    end = len(ids)
    alone = len(prompt[4]) + len(comp[4])
    assert layout.rows[-1] == ([(end - alone, end)], 0)  # the row alone: one causal segment
    assert packed.plan.shared and packed.plan.calls <= 2
    values = torch.arange(len(packed.labels), dtype=torch.float32) + 1
    assert torch.equal(unpack(values, packed)[mb.completion_mask.bool()], values)


def _shared_vs_plain(model, mb, temperature=0.9):
    """Max abs differences, shared against plain packed: per-token log-probs, entropies, a loss that weighs every
    token differently (advantage-like signs), and its gradient; with the largest gradient (not all zero)."""
    from grpo_dist.logprobs import selective_log_probs_and_entropy
    from grpo_dist.packing import completion_forward
    params = [p for p in model.parameters() if p.requires_grad]
    mask = mb.completion_mask.bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = {}
    for share in (False, True):
        logits, labels, to_rows = completion_forward(model, mb, True, share_prompts=share)
        logp, ent = selective_log_probs_and_entropy(logits, labels, temperature=temperature)
        logp, ent = to_rows(logp), to_rows(ent)
        loss = ((logp * weights.to(logp.dtype) + 0.1 * ent) * mask).sum()
        out[share] = logp.detach(), ent.detach(), loss.detach(), torch.autograd.grad(loss, params)
    (lp0, e0, l0, g0), (lp1, e1, l1, g1) = out[False], out[True]
    return {"logp": float((lp0 - lp1)[mask].abs().max()), "entropy": float((e0 - e1)[mask].abs().max()),
            "loss": float((l0 - l1).abs()), "grad": max(float((a - b).abs().max()) for a, b in zip(g0, g1)),
            "grad_max": max(float(a.abs().max()) for a in g0)}


def test_shared_equals_plain_packed_on_the_tiny_model():
    batch, _ = fixed_rollout()
    d = _shared_vs_plain(_tiny().train(), batch.rows(list(range(len(batch)))))
    assert d["grad_max"] > 1e-3, d
    assert max(v for k, v in d.items() if k != "grad_max") <= TOL, d


def _real_groups(groups=3, G=4, seed=5):
    """Real-vocabulary rows, G per prompt, uneven prompts (left-padded) and completions (right-padded)."""
    from grpo_dist.rollout import RolloutBatch
    g = torch.Generator().manual_seed(seed)
    P, C, n = 12, 16, groups * G
    pi, pm = torch.zeros(n, P, dtype=torch.long), torch.zeros(n, P, dtype=torch.long)
    ci, cm = torch.zeros(n, C, dtype=torch.long), torch.zeros(n, C, dtype=torch.long)
    for k in range(groups):
        p = int(torch.randint(3, P + 1, (1,), generator=g))
        prompt = torch.randint(100, 40000, (p,), generator=g)
        for j in range(G):
            i, c = k * G + j, int(torch.randint(1, C + 1, (1,), generator=g))
            pi[i, P - p:], pm[i, P - p:] = prompt, 1
            ci[i, :c], cm[i, :c] = torch.randint(100, 40000, (c,), generator=g), 1
    return RolloutBatch(pi, pm, ci, cm, G).rows(list(range(n)))


def _rms_norm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.real_model
def test_shared_equals_plain_packed_on_smollm2(smollm2_dir, monkeypatch):
    """SmolLM2-135M in float64. Its RMSNorm computes in fp32 whatever the model's dtype (transformers' Llama norm
    casts to float32), so a prompt token's gradient, summed over its rows before that norm's backward (shared)
    rather than after (one copy per row), differs at fp32 rounding: measured 1e-7 relative, 5e-5 absolute on
    gradients of ~500. The norm is run in the input dtype here, so what is compared is the sharing itself (it then
    agrees to ~1e-13). In fp32 as the trainer runs it, the two paths block the attention differently (a prompt's
    keys in one call with several completions' queries), and 30 layers take that rounding to ~2e-5 in log-probs
    (measured 1.8e-5), as padded against packed (tests/test_packing.py): checked there against 1e-4."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).train()
    mb = _real_groups()
    fp32 = _shared_vs_plain(model, mb)
    assert fp32["logp"] <= 10 * TOL and fp32["entropy"] <= 10 * TOL, fp32
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
    d = _shared_vs_plain(model.double(), mb)
    assert d["grad_max"] > 1.0, d
    assert max(v for k, v in d.items() if k != "grad_max") <= TOL, d


def test_a_forward_that_ignored_the_plan_raises():
    """Eager attention never reads the plan: the stream would be attended as one causal sequence; refused."""
    from grpo_dist.packing import pack_rows, packed_logits, share_prompts_reason
    batch, _ = fixed_rollout()
    model = _tiny("eager")
    assert "eager" in share_prompts_reason(model)
    with pytest.raises(RuntimeError, match="share_prompts"):
        packed_logits(model, pack_rows(batch.rows([0, 1, 2]), share_prompts=True))


def test_group_order_keeps_a_prompts_rows_together():
    from grpo_dist.micro_batches import row_lengths
    from grpo_dist.prompt_sharing import group_order
    batch, _ = fixed_rollout()
    rows = [r for r in range(len(batch)) if r != 6]  # one row of prompt 1 left out (e.g. a truncated one)
    order = group_order(batch.prompt_ids, batch.prompt_mask, rows, row_lengths(batch, rows))
    assert sorted(order) == rows
    for p in range(PROMPTS):  # fixed_rollout: 4 rows per prompt, each prompt's rows one contiguous run
        at = [i for i, r in enumerate(order) if r // 4 == p]
        assert at == list(range(at[0], at[0] + len(at))), (p, order)


def _trainer(rank, world_size, overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = GRPOTrainer(load_config(None, BASE + ["output_dir=/tmp/unused", f"prompts_per_rank={PROMPTS}",
                                                        "micro_batch_size=8", "num_iterations=2"] + overrides),
                              init_distributed(120))
    batch, rewards = fixed_rollout()
    micro = trainer.learner.micro_batches(batch, list(range(len(batch))))
    from grpo_dist import learner as trainer_module
    built, pack_rows = [], trainer_module.pack_rows
    trainer_module.pack_rows = lambda *a, **k: built.append(1) or pack_rows(*a, **k)  # layouts built this step
    m = trainer.learn(batch, rewards)
    m["_layouts_built"] = len(built)
    sd, _ = trainer.engine.gather_full_state()
    return trainer.share_prompts, out.getvalue(), micro, m, {k: v.clone() for k, v in sd.items()}


@pytest.mark.slow
def test_trainer_with_shared_prompts_equals_without(tmp_path):
    """One learn step (reference, old and 2 training passes) with share_prompts on and off: the same weights and
    metrics within 1e-5; each micro-batch's packed layout built once for all four passes; tokens/shared_* written
    out from the micro-batches (each prompt computed once per micro-batch instead of once per row); on eager
    attention it falls back with one line."""
    on, _, micro, m1, sd1 = run_ranks(_trainer, 1, tmp_path, ["share_prompts=true"])[0]
    off, _, _, m0, sd0 = run_ranks(_trainer, 1, tmp_path, ["share_prompts=false"])[0]
    assert on and not off
    # the reference, old and both training passes read one layout per micro-batch, built once in the step
    assert m1["_layouts_built"] == m0["_layouts_built"] == sum(1 for idx in micro if idx)
    assert max((sd0[k] - sd1[k]).abs().max().item() for k in sd0) <= TOL
    for key in ("loss", "kl", "entropy", "clip_fraction", "ratio_mean", "policy_loss", "grad_norm"):
        assert abs(m0[key] - m1[key]) <= TOL * max(1.0, abs(m0[key])), key
    batch, _ = fixed_rollout()
    shared = 0
    for idx in micro:
        assert [r // 4 for r in idx] == sorted(r // 4 for r in idx)  # a prompt's rows side by side
        for p in set(r // 4 for r in idx):
            rows = [r for r in idx if r // 4 == p]
            shared += (len(rows) - 1) * int(batch.prompt_mask[rows[0]].sum())
    for p, n in (("train", 2), ("reference", 1), ("old", 1)):
        assert m1[f"tokens/shared_{p}"] == n * shared and m0[f"tokens/shared_{p}"] == 0, p
        assert m1[f"tokens/processed_{p}"] + m1[f"tokens/shared_{p}"] == m1[f"tokens/useful_{p}"], p
        assert m1[f"tokens/useful_{p}"] == m0[f"tokens/useful_{p}"] == m0[f"tokens/processed_{p}"], p
    eager, printed, _, _, _ = run_ranks(_trainer, 1, tmp_path, ["model.attn_implementation=eager"])[0]
    assert not eager and printed.count("[grpo_dist] share_prompts: attention implementation 'eager'") == 1


@pytest.mark.parametrize("seed", range(3))
def test_token_budget_plan_costs_a_prompt_once_and_keeps_groups_whole_where_they_fit(seed):
    """Groups of rows with one prompt: every row once, each micro-batch within the row cap and within the budget
    counted with the prompt once per group (a lone item over it alone), and a group whose rows fit the budget and
    the cap in one micro-batch."""
    import random

    from grpo_dist.micro_batches import plan_token_budget
    rnd = random.Random(seed)
    lengths, groups, r = {}, [], 0
    for _ in range(12):
        p, g = rnd.randint(5, 60), rnd.choice([1, 4, 8])
        groups.append(list(range(r, r + g)))
        for i in range(r, r + g):
            lengths[i] = (p, rnd.randint(1, 90))
        r += g
    group_of = {i: k for k, g in enumerate(groups) for i in g}
    for budget, cap in ((200, 16), (400, 8), (1000, 64)):
        plan = plan_token_budget(lengths, budget, cap, True, groups=groups)
        assert sorted(i for mb in plan for i in mb) == sorted(lengths)
        for mb in plan:
            ks = {group_of[i] for i in mb}
            cost = sum(lengths[groups[k][0]][0] for k in ks) + sum(lengths[i][1] for i in mb)
            assert len(mb) <= cap and (cost <= budget or len(ks) == 1), (mb, cost)
        for g in groups:
            if len(g) <= cap and lengths[g[0]][0] + sum(lengths[i][1] for i in g) <= budget:
                assert any(set(g) <= set(mb) for mb in plan), g

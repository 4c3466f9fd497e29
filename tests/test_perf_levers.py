"""The performance levers keep the semantics: the lean sampling loop, inverse-CDF draws, top-k/top-p filtering,
chunked log-probs (also with the gradient written over the logits) and completion-only logits."""

import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.models import load_model, load_tokenizer
from grpo_dist.rollout import (_filter_scores, completion_logits, generate_rollouts, sample_from_scores,
                               sequence_inputs)

pytestmark = [pytest.mark.fast,  # the `make fast` tier
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


TINY = ModelConfig(tiny=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64))
PROMPTS, REFS = ["1+2=", "17+18=", "3+4+5+6+7="], ["3", "35", "25"]


def _model():
    tok = load_tokenizer(TINY)
    return tok, load_model(TINY, tok).eval()


def test_greedy_lean_loop_equals_hf_generate_with_padding_min_length_and_early_stop():
    tok, model = _model()
    # EOS made likely so rows end early and at different steps (the loop must pad after EOS and stop when all end)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 0.5 * model.lm_head.weight.mean(0)
    for kw in [dict(), dict(min_completion_length=6), dict(max_completion_length=3)]:
        args = dict(num_generations=2, max_completion_length=20, do_sample=False) | kw
        lean = generate_rollouts(model, tok, PROMPTS, REFS, **args)
        hf = generate_rollouts(model, tok, PROMPTS, REFS, use_hf_generate=True, **args)
        assert torch.equal(lean.completion_ids, hf.completion_ids), kw
        assert torch.equal(lean.completion_mask, hf.completion_mask), kw
        assert lean.completions == hf.completions
        if "min_completion_length" in kw:
            assert (lean.completion_lengths >= 6).all()


def test_filter_scores_matches_the_definition_of_top_k_and_top_p():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 50, generator=g) * 2
    for k, p in [(0, 1.0), (5, 1.0), (0, 0.7), (10, 0.5), (0, 0.0001)]:
        out = _filter_scores(scores, k, p)
        for row, kept_row in zip(scores, out):
            order = row.argsort(descending=True)
            keep = set(order[:k].tolist()) if k else set(range(50))
            if p < 1.0:  # smallest set of most likely tokens whose mass reaches p (the top one always stays)
                probs = (row if not k else row.masked_fill(~torch.isin(torch.arange(50),
                                                                       order[:k]), float("-inf"))).softmax(-1)
                mass, nucleus = 0.0, set()
                for i in probs.argsort(descending=True).tolist():
                    nucleus.add(i)
                    mass += float(probs[i])
                    if mass >= p - 1e-6:
                        break
                keep &= nucleus
            assert set(torch.isfinite(kept_row).nonzero().flatten().tolist()) == keep, (k, p)


def test_inverse_cdf_draws_follow_softmax_and_never_pick_filtered_tokens():
    torch.manual_seed(0)
    scores = torch.tensor([[2.0, 1.0, float("-inf"), 0.0, -1.0, float("-inf")]]).repeat(20000, 1)
    draws = sample_from_scores(scores)
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    expected = scores[0].softmax(-1)
    assert freq[2] == 0 and freq[5] == 0
    assert (freq - expected).abs().max() < 0.015, (freq, expected)


def test_sampling_is_reproducible_and_respects_min_length():
    tok, model = _model()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate_rollouts(model, tok, PROMPTS, REFS, num_generations=3, max_completion_length=12,
                                      temperature=0.8, top_k=20, top_p=0.9, min_completion_length=12))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert (runs[0].completion_lengths == 12).all()


def test_chunked_log_probs_equal_naive_values_and_grads_also_when_overwriting_logits():
    import grpo_dist.logprobs as L
    g = torch.Generator().manual_seed(1)
    rows, vocab = 37, 30000  # CHUNK_ELEMENTS // vocab = 139 rows per chunk: force several chunks below
    logits0 = torch.randn(rows, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.randn(rows, generator=g)
    for t in (1.0, 0.7):
        x = logits0.clone().requires_grad_()
        naive = torch.log_softmax(x / t, -1).gather(-1, labels[:, None]).squeeze(-1)
        (naive * w).sum().backward()
        for overwrite in (False, True):
            for chunk in (1024, 5):
                y = logits0.clone().requires_grad_()
                h = y * 1.0  # a non-leaf, like the lm_head output
                lp = L.selective_log_probs(h, labels, chunk, t, overwrite_logits=overwrite)
                (lp * w).sum().backward()
                assert torch.allclose(lp, naive, atol=1e-5, rtol=0), (t, overwrite, chunk)
                assert torch.allclose(y.grad, x.grad, atol=1e-5, rtol=0), (t, overwrite, chunk)
    with torch.no_grad():
        assert torch.equal(L.selective_log_probs(logits0, labels, 3),
                           torch.log_softmax(logits0, -1).gather(-1, labels[:, None]).squeeze(-1))


def test_completion_logits_are_the_completion_slice_of_the_full_forward():
    tok, model = _model()
    torch.manual_seed(0)
    batch = generate_rollouts(model, tok, PROMPTS, REFS, num_generations=2, max_completion_length=5)
    with torch.no_grad():
        full = model(**sequence_inputs(batch)).logits
        got = completion_logits(model, batch)
    p, c = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    assert got.is_contiguous() and got.shape == (len(batch), c, full.shape[-1])
    assert torch.allclose(got, full[:, p - 1:p + c - 1], atol=1e-5)


def _rank0_load(rank, world_size, model_dir):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines import clean_name
    from grpo_dist.models import load_on_rank0_only
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    cfg = load_config(None, [f"model.name_or_path={model_dir}", "beta=0.04", "reward_workers=0", "report_to=[]",
                             "progress_bar=false", "output_dir=/tmp/unused", "num_generations=2",
                             "prompts_per_rank=1", "max_completion_length=4", "micro_batch_size=2",
                             "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]"])
    assert load_on_rank0_only(cfg, world_size)
    tr = GRPOTrainer(cfg, ctx)
    tr.engine.copy_weights_to(tr.gen_model)
    out = {"replica": {k: v.clone() for k, v in tr.gen_model.named_parameters()},
           "buffers": {k: v.clone() for k, v in tr.gen_model.named_buffers()}}
    with FSDP.summon_full_params(tr.ref_model, writeback=False):
        out["ref"] = {clean_name(k): v.clone() for k, v in tr.ref_model.named_parameters()}
    out["ref_buffers"] = {clean_name(k): v.clone() for k, v in tr.ref_model.named_buffers()}
    out["loss"] = tr.train_step()["loss"]  # and a whole step runs on the meta-built ranks
    return out


@pytest.mark.slow  # 2 spawned ranks: ~30 s
def test_pretrained_weights_read_by_rank0_reach_every_rank_exactly(tmp_path):
    from dist_utils import run_ranks
    tied = ModelConfig(tiny=dict(TINY.tiny, tie_word_embeddings=True))  # like Qwen2.5-0.5B: lm_head = embeddings
    tok = load_tokenizer(tied)
    model = load_model(tied, tok).eval()
    with torch.no_grad():  # weights no seeded init can reproduce
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    saved = {k: v.clone() for k, v in model.named_parameters()}
    ranks = run_ranks(_rank0_load, 2, tmp_path, str(tmp_path / "m"))
    for r, res in enumerate(ranks):
        for part in ("replica", "ref"):
            assert res[part].keys() == saved.keys()
            for k, v in saved.items():
                assert torch.equal(res[part][k], v), (r, part, k)
        for k, v in ranks[0]["buffers"].items():  # e.g. rotary inv_freq, built for real on the meta ranks
            assert torch.equal(res["buffers"][k], v) and torch.isfinite(v).all(), (r, k)
            assert torch.equal(res["ref_buffers"][k], v), (r, k)
        assert res["loss"] == ranks[0]["loss"]

"""Rollout masks, left padding and the scoring forward pass."""

import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.logprobs import selective_log_probs
from grpo_dist.models import load_model, load_tokenizer
from grpo_dist.rollout import completion_logits, completion_mask_from_ids, generate_rollouts

pytestmark = pytest.mark.fast  # the `make fast` tier

TINY = ModelConfig(tiny=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64))


def test_completion_mask_includes_first_eos_and_excludes_padding_after_it():
    eos, pad = 1, 0
    ids = torch.tensor([[5, 6, eos, pad, pad],    # ends early: EOS in, padding out
                        [5, eos, 7, eos, pad],    # only the FIRST EOS ends it
                        [5, 6, 7, 8, 9],          # truncated: all in
                        [eos, pad, pad, pad, pad]])
    mask = completion_mask_from_ids(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    # pad == eos (GPT-2 style) and several EOS ids
    assert completion_mask_from_ids(torch.tensor([[3, 2, 2, 2]]), 2).tolist() == [[1, 1, 0, 0]]
    assert completion_mask_from_ids(torch.tensor([[3, 9, 4, 2]]), [2, 9]).tolist() == [[1, 1, 0, 0]]


def _model():
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok).eval()
    return tok, model


def test_left_padded_batch_scores_like_each_row_alone():
    tok, model = _model()
    torch.manual_seed(0)
    prompts = ["1+2=", "17+18=", "3+4+5+6+7="]  # different lengths -> different left padding
    batch = generate_rollouts(model, tok, prompts, ["3", "35", "25"], num_generations=2, max_completion_length=6)
    assert batch.prompt_ids.shape[0] == 6 and batch.completion_mask.shape == batch.completion_ids.shape
    assert (batch.prompt_mask[0] == 0).any(), "shortest prompt must be left-padded"
    with torch.no_grad():
        together = selective_log_probs(completion_logits(model, batch), batch.completion_ids)
        for i in range(len(batch)):
            alone = batch.rows([i])  # trimmed: no padding at all on either side
            assert alone.prompt_mask.all() and alone.completion_mask.all()
            lp = selective_log_probs(completion_logits(model, alone), alone.completion_ids)
            n = int(batch.completion_mask[i].sum())
            assert torch.allclose(together[i, :n], lp[0], atol=1e-5), i


def test_greedy_tokens_are_the_argmax_of_the_scoring_pass():
    """Positions and masks used for scoring match the ones generate used."""
    tok, model = _model()
    batch = generate_rollouts(model, tok, ["5+5=", "12+13+14="], ["10", "39"], num_generations=1,
                              max_completion_length=8, do_sample=False)
    with torch.no_grad():
        pred = completion_logits(model, batch).argmax(-1)
    m = batch.completion_mask.bool()
    assert torch.equal(pred[m], batch.completion_ids[m])


def test_texts_and_groups():
    tok, model = _model()
    torch.manual_seed(1)
    batch = generate_rollouts(model, tok, ["1+1=", "2+2="], ["2", "4"], num_generations=3, max_completion_length=5,
                              min_completion_length=5)
    assert batch.references == ["2", "2", "2", "4", "4", "4"]
    assert len(batch.completions) == 6
    # rows of one group share the prompt
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[2])
    assert torch.equal(batch.prompt_ids[3], batch.prompt_ids[5])
    for text, ids, m in zip(batch.completions, batch.completion_ids, batch.completion_mask):
        assert text == tok.decode(ids[m.bool()], skip_special_tokens=True)

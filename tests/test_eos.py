"""A completion ends at any id of generation_config.eos_token_id (an int or a list) as well as at the tokenizer's
EOS, as `generate` stops (Qwen2.5 Instruct lists two EOS ids): in the lean decoder, the transformers-forward loop,
`generate`, sampling, and the greedy pass that evaluation runs."""

import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.models import load_model, load_tokenizer
from grpo_dist.rollout import eos_token_ids, generate_rollouts

TINY = ModelConfig(tiny=dict(architecture="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64))
PROMPTS = ["1+2=", "17+18=", "3+4+5+6+7=", "9*9="]
PATHS = {"lean": {}, "hf_forward": dict(lean_decoder=False), "generate": dict(use_hf_generate=True)}


def _greedy(model, tok, **kw):
    return generate_rollouts(model, tok, PROMPTS, ["0"] * len(PROMPTS), num_generations=1,
                             max_completion_length=10, do_sample=False, **kw)


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok).eval()
    free = _greedy(model, tok)  # only the tokenizer's EOS
    assert free.completion_mask.all(), "pick a model whose greedy text does not end by itself"
    # a second EOS id: the token row 0 emits at position 3, which it has not emitted before
    row = free.completion_ids[0].tolist()
    second = row[3]
    assert second not in row[:3] and second != tok.eos_token_id
    return tok, model, free, second


def test_eos_ids_merge_the_tokenizer_and_the_generation_config(setup):
    tok, model, _, second = setup
    assert eos_token_ids(model, tok) == [tok.eos_token_id]
    model.generation_config.eos_token_id = [second, tok.eos_token_id]
    try:
        assert eos_token_ids(model, tok) == [tok.eos_token_id, second]
        model.generation_config.eos_token_id = second
        assert eos_token_ids(model, tok) == [tok.eos_token_id, second]
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_completions_end_at_a_generation_config_eos(setup, path):
    tok, model, free, second = setup
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    try:
        batch = _greedy(model, tok, **PATHS[path])
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    ends = []
    for row in free.completion_ids.tolist():  # where each row must now end: at its first `second`, EOS included
        ends.append(row.index(second) + 1 if second in row else len(row))
    assert ends[0] == 4
    assert batch.completion_mask.sum(-1).tolist() == ends
    for i, n in enumerate(ends):
        assert batch.completion_ids[i, :n].tolist() == free.completion_ids[i, :n].tolist()
        assert (batch.completion_ids[i, n:] == tok.pad_token_id).all()


def test_sampled_completions_stop_at_the_first_of_either_eos(setup):
    tok, model, _, second = setup
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    torch.manual_seed(0)
    try:
        batch = generate_rollouts(model, tok, PROMPTS, ["0"] * 4, num_generations=8, max_completion_length=12,
                                  temperature=1.5)
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    stops = {tok.eos_token_id, second}
    ended = 0
    for ids, n in zip(batch.completion_ids.tolist(), batch.completion_mask.sum(-1).tolist()):
        assert not stops & set(ids[:n - 1])  # nothing before the last kept token ends a completion
        assert ids[n - 1] in stops or n == 12
        ended += ids[n - 1] == second
    assert ended > 0  # the second id really ended some rows

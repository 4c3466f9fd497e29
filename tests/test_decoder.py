"""grpo_dist.decoder: the lean KV-cached decoder computes what the transformers forward computes.

Logits of a prefill + token-by-token decode are compared with one transformers forward over the whole sequence
(left padding, shared prompt prefixes, every supported architecture, biases, tied embeddings, bf16); the fused
replica keeps its parameters' values and follows in-place weight refreshes; unsupported models are named and fall
back to the transformers forward."""

import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.decoder import (LeanDecoder, fuse_projections, fused_projections, lean_decoder_unsupported,
                               prepare_replica)
from grpo_dist.models import load_model, load_tokenizer
from grpo_dist.rollout import HFDecoder, generate_rollouts, make_decoder

pytestmark = [pytest.mark.fast,  # the `make fast` tier
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


def _model(arch="qwen2", dtype="float32", **tiny):
    spec = dict(architecture=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64) | tiny
    cfg = ModelConfig(tiny=spec, dtype=dtype)
    tok = load_tokenizer(cfg)
    return tok, load_model(cfg, tok).eval().requires_grad_(False)


def _reference_logits(model, ids, mask, gen):
    """One transformers forward over [prompt | generated]: logits predicting each generated position."""
    full = torch.cat([ids, gen], 1)
    full_mask = torch.cat([mask, torch.ones_like(gen)], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits
    return logits[:, ids.shape[1] - 1:-1]


def _decoder_logits(decoder, ids, mask, gen, repeats):
    """Prefill the unique prompts, then feed gen's tokens (one row per decoded row) one at a time."""
    with torch.inference_mode():
        out = [decoder.prefill(ids, mask, repeats, gen.shape[1])]
        for t in range(gen.shape[1] - 1):
            out.append(decoder.step(gen[:, t]))
    return torch.stack(out, 1)


def _inputs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of different widths
    mask[1, :1] = 0
    return ids * mask, mask, g


@pytest.mark.parametrize("arch,extra", [
    ("qwen2", {}),                                   # q/k/v biases, GQA
    ("qwen3", {}),                                   # per-head q/k RMSNorm
    ("llama", {}),
    ("llama", dict(num_key_value_heads=4)),          # multi-head (no GQA)
    ("qwen2", dict(tie_word_embeddings=True)),
])
@pytest.mark.parametrize("fused", [False, True])
def test_prefill_and_decode_logits_equal_the_transformers_forward(arch, extra, fused):
    tok, model = _model(arch, **extra)
    if fused:
        assert prepare_replica(model)
    ids, mask, g = _inputs(len(tok))
    repeats = torch.tensor([2, 1, 3])  # rows continuing each prompt: the prefix is prefilled once per prompt
    gen = torch.randint(5, len(tok), (int(repeats.sum()), 7), generator=g)
    expected = torch.cat([_reference_logits(model, ids[i:i + 1].expand(int(r), -1), mask[i:i + 1].expand(int(r), -1),
                                            gen[int(repeats[:i].sum()):int(repeats[:i + 1].sum())])
                          for i, r in enumerate(repeats)])
    got = _decoder_logits(LeanDecoder(model), ids, mask, gen, repeats)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # without repeats: one decoded row per prompt
    got = _decoder_logits(LeanDecoder(model), ids, mask, gen[:3], None)
    torch.testing.assert_close(got, _reference_logits(model, ids, mask, gen[:3]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_llama_with_attention_and_mlp_biases(fused):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok, _ = _model("llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=len(tok),
                                         attention_bias=True, mlp_bias=True)).eval().requires_grad_(False)
    with torch.no_grad():  # biases start at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    if fused:
        fuse_projections(model)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert model.model.layers[0].mlp.down_proj.bias is not None
    ids, mask, g = _inputs(len(tok))
    gen = torch.randint(5, len(tok), (3, 5), generator=g)
    torch.testing.assert_close(_decoder_logits(LeanDecoder(model), ids, mask, gen, None),
                               _reference_logits(model, ids, mask, gen), atol=2e-5, rtol=1e-5)


def test_bf16_matches_the_transformers_forward_to_bf16_precision():
    tok, model = _model("qwen2", dtype="bfloat16")
    ids, mask, g = _inputs(len(tok))
    gen = torch.randint(5, len(tok), (3, 6), generator=g)
    got = _decoder_logits(LeanDecoder(model), ids, mask, gen, None)
    expected = _reference_logits(model, ids, mask, gen)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: a few units in the last place of the logits' scale
    assert (got.float() - expected.float()).abs().max() < 0.05 * expected.float().abs().max()


def test_fused_replica_keeps_values_and_follows_in_place_refreshes():
    tok, model = _model("qwen2")
    _, other = _model("qwen2")
    with torch.no_grad():  # a different policy to copy in, as the trainer's refresh does
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids, mask, g = _inputs(len(tok))
    gen = torch.randint(5, len(tok), (3, 4), generator=g)
    before = _reference_logits(model, ids, mask, gen)
    fused = fuse_projections(model)
    assert fuse_projections(model) is fused  # idempotent
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused[0]["qkv_w"].untyped_storage().data_ptr()
    assert torch.equal(_reference_logits(model, ids, mask, gen), before)  # the model computes what it did
    with torch.no_grad():
        src = dict(other.named_parameters())
        for name, p in model.named_parameters():
            p.copy_(src[name])
    assert torch.equal(fused[0]["qkv_w"][:32], attn.q_proj.weight)
    torch.testing.assert_close(_decoder_logits(LeanDecoder(model), ids, mask, gen, None),
                               _reference_logits(other, ids, mask, gen), atol=2e-5, rtol=1e-5)


def test_replaced_parameters_are_detected_and_decoding_stays_correct():
    tok, model = _model("qwen2")
    fuse_projections(model)
    attn = model.model.layers[1].self_attn
    attn.v_proj.weight.data = attn.v_proj.weight.detach().clone() + 1.0  # no longer a view of the buffer
    assert fused_projections(model) is None
    ids, mask, g = _inputs(len(tok))
    gen = torch.randint(5, len(tok), (3, 4), generator=g)
    torch.testing.assert_close(_decoder_logits(LeanDecoder(model), ids, mask, gen, None),
                               _reference_logits(model, ids, mask, gen), atol=2e-5, rtol=1e-5)
    assert fuse_projections(model) is not None and fused_projections(model) is not None  # fused afresh


def test_unsupported_models_are_named_and_fall_back():
    tok, model = _model("qwen2")
    assert lean_decoder_unsupported(model, 100) is None
    model.config.hidden_act = "gelu"
    assert "silu" in lean_decoder_unsupported(model, 100)
    model.config.hidden_act = "silu"
    model.model.layers[0].self_attn.sliding_window = 16
    assert "sliding window 16" in lean_decoder_unsupported(model, 100)
    assert lean_decoder_unsupported(model, 16) is None
    assert isinstance(make_decoder(model, 100), HFDecoder)
    model.model.layers[0].self_attn.sliding_window = None
    assert isinstance(make_decoder(model, 100), LeanDecoder)
    assert isinstance(make_decoder(model, 100, lean=False), HFDecoder)
    model.model.rotary_emb.rope_type = "dynamic"
    assert "dynamic" in lean_decoder_unsupported(model, 100)

    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tok)))
    assert "gpt2" in lean_decoder_unsupported(gpt2, 100)
    assert not prepare_replica(gpt2)
    out = generate_rollouts(gpt2.eval(), tok, ["1+2=", "3+4="], ["3", "7"], num_generations=2,
                            max_completion_length=4, do_sample=False)
    assert out.completion_ids.shape[0] == 4


def test_mistral_and_its_config_level_sliding_window():
    from transformers import MistralConfig, MistralForCausalLM
    tok, _ = _model("llama")
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=len(tok), sliding_window=None, head_dim=16)
    model = MistralForCausalLM(config).eval().requires_grad_(False)
    ids, mask, g = _inputs(len(tok))
    gen = torch.randint(5, len(tok), (3, 5), generator=g)
    assert lean_decoder_unsupported(model, 11) is None
    torch.testing.assert_close(_decoder_logits(LeanDecoder(model), ids, mask, gen, None),
                               _reference_logits(model, ids, mask, gen), atol=2e-5, rtol=1e-5)
    model.config.sliding_window = 8  # Mistral-7B-v0.1 style: the window is in the config, not on the layers
    assert "sliding window 8" in lean_decoder_unsupported(model, 11)
    assert lean_decoder_unsupported(model, 8) is None


@pytest.mark.parametrize("generation_batch_size", [None, 3])
def test_rollouts_equal_the_transformers_forward_path(generation_batch_size):
    """Greedy rollouts token for token, EOS made likely so rows end at different steps; a generation batch of 3
    splits groups of 2 across chunks (the shared prefix must follow the rows)."""
    tok, model = _model("qwen2")
    prompts, refs = ["1+2=", "17+18=", "3+4+5+6+7="], ["3", "35", "25"]
    args = dict(num_generations=2, max_completion_length=12, do_sample=False,
                generation_batch_size=generation_batch_size)
    # EOS takes over (a scaled copy of) the output row of a token that some rows pick mid-way and others never
    first = generate_rollouts(model, tok, prompts, refs, lean_decoder=False, **args).completion_ids
    counts = torch.bincount(first[:, 2:].flatten(), minlength=len(tok))
    rows_using = torch.tensor([[(first[r, 2:] == t).any() for t in range(len(tok))] for r in range(len(first))])
    candidates = ((rows_using.sum(0) > 0) & (rows_using.sum(0) < len(first))).nonzero().flatten()
    token = int(candidates[counts[candidates].argmax()])
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[token]
    hf = generate_rollouts(model, tok, prompts, refs, lean_decoder=False, **args)
    prepare_replica(model)
    lean = generate_rollouts(model, tok, prompts, refs, **args)
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    assert torch.equal(lean.completion_mask, hf.completion_mask)
    assert lean.completions == hf.completions
    assert len(set(lean.completion_lengths.tolist())) > 1  # rows did end at different steps


def test_sampled_rows_of_a_group_are_independent_draws():
    """The G rows that share a prefilled prompt must not share their samples."""
    tok, model = _model("qwen2")
    prepare_replica(model)
    torch.manual_seed(0)
    out = generate_rollouts(model, tok, ["1+2="], ["3"], num_generations=8, max_completion_length=10,
                            min_completion_length=10)
    assert len({tuple(r) for r in out.completion_ids.tolist()}) == 8

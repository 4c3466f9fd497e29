"""The mfu and tokens/s metrics (grpo_dist/flops.py), the formula written out here:

    F = 6 N T_train + 2 N (T_reference + T_old) + A (3 I + P),   A = 2 d_q L sum_rows s (s + 1)
    mfu = F / (step_time_s x peak_flops x ranks)
"""

import pytest
import torch

from helpers import EQUIV_BASE, G, PROMPTS, fixed_rollout, in_process


@pytest.mark.fast
def test_step_flops_by_the_formula():
    from grpo_dist import flops
    tokens = {"tokens/useful_train": 100.0, "tokens/shared_train": 10.0, "tokens/useful_reference": 50.0,
              "tokens/shared_reference": 5.0, "tokens/useful_old": 50.0, "tokens/shared_old": 5.0}
    n, layers, d_q, pairs, iterations = 1000, 2, 64, 500.0, 2
    attention = 2 * d_q * layers * pairs
    update, no_grad = flops.step_flops(n, layers, d_q, tokens, pairs, iterations)
    assert update == 6 * n * 90 + 3 * attention * iterations
    assert no_grad == 2 * n * (45 + 45) + attention * 2  # two no-grad passes ran
    m = flops.metrics(update, no_grad, tokens, {"update": 2.0, "logprobs": 1.0, "step": 4.0}, 1e6, ranks=2)
    assert m["mfu"] == pytest.approx((update + no_grad) / (4.0 * 1e6 * 2))
    assert m["mfu_update"] == pytest.approx(update / (2.0 * 1e6 * 2))
    assert m["tokens_per_s_update"] == 45.0 and m["tokens_per_s_logprobs"] == 90.0
    without_peak = flops.metrics(update, no_grad, tokens, {"update": 2.0, "step": 4.0}, None, ranks=1)
    assert without_peak["mfu"] is None and without_peak["mfu_update"] is None
    assert flops.peak_flops(None, torch.device("cpu")) is None and flops.peak_flops(5e12, torch.device("cpu")) == 5e12


@pytest.mark.fast
def test_matmul_params_leave_out_an_untied_input_embedding():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from grpo_dist import flops
    for tied in (True, False):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                             tie_word_embeddings=tied))
        total = sum(p.numel() for p in model.parameters())
        assert flops.matmul_params(model) == (total if tied else total - 100 * 16)
    assert flops.attention_dims(model.config) == (1, 16)


def test_the_step_metrics_count_the_trained_rows_attention(tmp_path):
    """learn() on the fixed rollout: the attention term sums s (s + 1) over the rows of the groups that train (group
    1 is flat and skipped); mfu is null on a CPU without peak_flops, and by the formula with it."""
    def run():
        from grpo_dist.config import load_config
        from grpo_dist.distributed import init_distributed
        from grpo_dist.step_metrics import flops_metrics
        from grpo_dist.trainer import GRPOTrainer, Timer
        batch, rewards = fixed_rollout()
        cfg = load_config(None, EQUIV_BASE + [f"prompts_per_rank={PROMPTS}", f"output_dir={tmp_path}",
                                              "peak_flops=1e9", "num_iterations=2",
                                              "skip_zero_advantage_groups=true"])
        tr = GRPOTrainer(cfg, init_distributed(60))
        metrics = tr.learn(batch, rewards)
        pairs = tr.last_step.attention_pairs
        s = (batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)).double()
        trained = [i for i in range(PROMPTS * G) if i // G != 1]
        assert pairs == float((s[trained] * (s[trained] + 1)).sum())
        timer = Timer()
        timer.times.update(update=0.5, logprobs=0.25)
        metrics["step_time_s"] = 1.0
        out = flops_metrics(tr.cfg, tr._flops_shape, tr._peak_flops, metrics, timer.times, pairs)
        n, layers, d_q = tr._flops_shape
        computed = {p: metrics[f"tokens/useful_{p}"] - metrics[f"tokens/shared_{p}"] for p in ("train", "reference",
                                                                                             "old")}
        attention = 2 * d_q * layers * pairs
        want = 6 * n * computed["train"] + 2 * n * (computed["reference"] + computed["old"]) + attention * (3 * 2 + 2)
        assert out["model_flops"] == pytest.approx(want)
        assert out["mfu"] == pytest.approx(want / 1e9)
        tr.cfg.peak_flops, tr._peak_flops = None, None
        assert flops_metrics(tr.cfg, tr._flops_shape, tr._peak_flops, metrics, timer.times, pairs)["mfu"] is None
    in_process(run)

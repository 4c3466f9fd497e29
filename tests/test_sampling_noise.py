"""Per-row sampling noise (grpo_dist/sampling_noise.py): a sampled completion depends only on (seed, step, global
prompt index, completion index), not on the batch it is sampled in, the chunking, the rank, or the number of ranks.
Greedy decoding is unchanged, and without row seeds the process RNG is used exactly as before."""

import numpy as np
import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.models import load_model, load_tokenizer
from grpo_dist.rollout import sample_from_scores
from grpo_dist.rollout_engines import ReplicaRolloutEngine, SamplingSpec
from grpo_dist.sampling_noise import EVAL_STREAM, row_noise, row_seed, row_seeds

from dist_utils import run_ranks

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("one_thread")]

TINY = ModelConfig(tiny=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64))


def test_row_seed_is_the_documented_hash_and_row_noise_its_generator():
    for seed, step, p, c in [(42, 0, 0, 0), (42, 3, 17, 5), (-1, 2, 1, 0)]:
        want = int(np.random.SeedSequence([seed % 2**64, 0, step, p, c]).generate_state(1, np.uint64)[0])
        assert row_seed(seed, step, p, c) == want
    assert row_seed(1, 0, 0, 0, EVAL_STREAM) != row_seed(1, 0, 0, 0)
    seeds = row_seeds(42, 3, [4, 9], 2)
    assert seeds == [row_seed(42, 3, 4, 0), row_seed(42, 3, 4, 1), row_seed(42, 3, 9, 0), row_seed(42, 3, 9, 1)]
    u = row_noise(seeds, 7, "cpu")
    for i, s in enumerate(seeds):
        assert torch.equal(u[i], torch.rand(7, generator=torch.Generator().manual_seed(s)))
    assert torch.equal(row_noise(seeds[2:], 7, "cpu"), u[2:])  # a row's noise does not see the others


def test_without_uniforms_the_process_rng_is_used_as_before():
    scores = torch.randn(5, 11)
    torch.manual_seed(3)
    cdf = scores.softmax(-1).cumsum_(-1)
    old = torch.searchsorted(cdf, torch.rand(5, 1) * cdf[:, -1:], right=True).squeeze(1)  # the former formula
    torch.manual_seed(3)
    assert torch.equal(sample_from_scores(scores), old)
    u = torch.tensor([0.0, 0.2, 0.5, 0.9, 0.999])  # inverse CDF: the first token whose CDF exceeds u * total
    want = [int((cdf[i] > u[i] * cdf[i, -1]).nonzero()[0]) for i in range(5)]
    assert sample_from_scores(scores, u).tolist() == want


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]  # different lengths: different left padding per batch


def _generate(engine, prompts, n, seeds, greedy=False):
    spec = SamplingSpec(n=n, max_tokens=8, eos_ids=(1,), temperature=0.9, top_k=40, row_seeds=seeds, greedy=greedy)
    return engine.generate(prompts, spec)


@pytest.mark.parametrize("lean", [True, False])
def test_a_prompt_samples_the_same_completions_alone_in_a_batch_or_in_chunks(lean):
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok).eval()
    n = 3
    seeds = row_seeds(7, 5, [10, 11, 12], n)
    engine = ReplicaRolloutEngine(model, lean, tok.pad_token_id)
    together = _generate(engine, PROMPTS, n, tuple(seeds))
    for i, p in enumerate(PROMPTS):
        alone = _generate(engine, [p], n, tuple(seeds[i * n:(i + 1) * n]))
        assert alone.completion_ids == together.completion_ids[i * n:(i + 1) * n], i
        for a, b in zip(alone.logprobs, together.logprobs[i * n:(i + 1) * n]):
            np.testing.assert_allclose(a, b, atol=1e-5)  # padding changes the float sums, not the draws
    chunked = _generate(ReplicaRolloutEngine(model, lean, tok.pad_token_id, batch_size=2), PROMPTS, n, tuple(seeds))
    assert chunked.completion_ids == together.completion_ids
    # the test can fail: with the process RNG a prompt alone draws differently from the same prompt in a batch
    torch.manual_seed(0)
    rng_together = _generate(engine, PROMPTS, n, None)
    torch.manual_seed(0)
    rng_alone = _generate(engine, [PROMPTS[1]], n, None)
    assert rng_alone.completion_ids != rng_together.completion_ids[n:2 * n]


def test_greedy_ignores_the_row_seeds_bitwise():
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok).eval()
    engine = ReplicaRolloutEngine(model, True, tok.pad_token_id)
    a = _generate(engine, PROMPTS, 1, tuple(row_seeds(1, 0, [0, 1, 2], 1)), greedy=True)
    b = _generate(engine, PROMPTS, 1, None, greedy=True)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


def test_sampled_evaluation_keys_the_noise_on_the_example_index_whatever_the_batch_size():
    from grpo_dist.config import load_config
    from grpo_dist.data import PromptExample
    from grpo_dist.evaluation import _score_examples
    from grpo_dist.rewards import RewardComputer
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok).eval()
    cfg = load_config(None, ["reward_workers=0", "max_completion_length=4", "data.preset=arithmetic"])
    examples = [PromptExample(index=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in (3, 8, 11)]
    rewards = RewardComputer(cfg.rewards, num_workers=0)

    class Recording(ReplicaRolloutEngine):
        def generate(self, prompt_ids, sampling):
            seen.extend(sampling.row_seeds)
            return super().generate(prompt_ids, sampling)

    for batch_size in (1, 3):
        seen: list[int] = []
        _score_examples(Recording(model, True, tok.pad_token_id), tok, examples, cfg, rewards, 2, True,
                        batch_size=batch_size, step=6)
        assert seen == row_seeds(cfg.seed, 6, [3, 8, 11], 2, EVAL_STREAM)


# ------------------------------------------------------------------------------------------ 1 rank vs 2 ranks
OVERRIDES = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
             "num_key_value_heads: 2, intermediate_size: 64}", "reward_workers=0", "progress_bar=false",
             "report_to=[]", "num_generations=3", "max_completion_length=6", "temperature=1.0",
             "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "output_dir=/tmp/unused_noise"]


def _rollouts(rank, world, prompts_per_rank, steps):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, OVERRIDES + [f"prompts_per_rank={prompts_per_rank}", "max_steps=1"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    torch.manual_seed(1000 + rank)  # the process RNG must not matter
    out = []
    for _ in range(steps):
        b = tr.rollout(tr.sampler.next_batch())
        out.append([(b.prompt_ids[i][b.prompt_mask[i].bool()].tolist(),
                     b.completion_ids[i][b.completion_mask[i].bool()].tolist(),
                     b.sampler_logprobs[i][b.completion_mask[i].bool()]) for i in range(len(b))])
    return out


@pytest.mark.heavy  # 1 then 2 spawned ranks: ~9 s; out of `make fast`
def test_one_rank_and_two_ranks_sample_the_same_completions_for_the_same_global_batch(tmp_path):
    one = run_ranks(_rollouts, 1, tmp_path, 4, 2)[0]
    two = run_ranks(_rollouts, 2, tmp_path, 2, 2)
    for step in range(2):
        joined = two[0][step] + two[1][step]  # rank 0's prompts, then rank 1's: the global batch's order
        assert len(joined) == len(one[step]) == 12
        for (p1, c1, lp1), (p2, c2, lp2) in zip(one[step], joined):
            assert p1 == p2 and c1 == c2
            torch.testing.assert_close(lp1, lp2, atol=1e-5, rtol=0)
    assert [c for _, c, _ in one[0]] != [c for _, c, _ in one[1]]  # another batch, other draws

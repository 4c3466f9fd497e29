"""Multi-turn environments (grpo_dist/environments/): the 1-turn environment is bitwise the plain rollout, the
driver's episodes score the same log-probs split into turns as in one pass, observation tokens never reach the
loss, and a 2-rank run trains with executed tool calls."""

import pytest
import torch

from helpers import EQUIV_BASE
from tool_envs import FixedObservationEnv, RaisingEnv, ScriptedPythonEnv

PROMPTS = ["12+7=", "3+30=", "9+9="]


def _model(dtype="float32"):
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, EQUIV_BASE + [f"model.dtype={dtype}", "output_dir=/tmp/unused_env"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    return load_model(cfg.model, tok).eval(), tok


def _spec(tok, model, n=4, max_tokens=24, seeds=True, greedy=False):
    from grpo_dist.rollout import eos_token_ids
    from grpo_dist.rollout_engines import SamplingSpec
    from grpo_dist.sampling_noise import row_seeds
    return SamplingSpec(n=n, max_tokens=max_tokens, eos_ids=tuple(eos_token_ids(model, tok)), temperature=0.9,
                        greedy=greedy, row_seeds=tuple(row_seeds(0, 1, range(len(PROMPTS)), n)) if seeds else None)


def _engine(model, tok, lean=True):
    from grpo_dist.rollout_engines import ReplicaRolloutEngine
    return ReplicaRolloutEngine(model, lean, tok.pad_token_id, compaction_threshold=0.5)


@pytest.mark.parametrize("lean", [True, False])
def test_one_turn_environments_are_bitwise_the_plain_rollout(lean):
    """SingleTurnEnv is generate_batch; a multi-turn environment whose turns never stop at a marker (no stop
    ids) gives the same tokens and sampler log-probs, all of them the model's (tool_mask 1)."""
    from grpo_dist.environments import SingleTurnEnv
    from grpo_dist.rollout_engines import generate_batch
    model, tok = _model()
    eng, spec = _engine(model, tok, lean), _spec(tok, model)
    plain = generate_batch(eng, tok, PROMPTS, ["19", "33", "18"], spec, 64, "cpu")
    single = SingleTurnEnv().rollout(eng, tok, PROMPTS, ["19", "33", "18"], spec, 64, "cpu")
    multi = FixedObservationEnv(tok, max_turns=1, stop_ids=()).rollout(eng, tok, PROMPTS, ["19", "33", "18"], spec,
                                                                       64, "cpu")
    for b in (single, multi):
        assert torch.equal(b.prompt_ids, plain.prompt_ids) and torch.equal(b.completion_ids, plain.completion_ids)
        assert torch.equal(b.completion_mask, plain.completion_mask)
        assert torch.equal(b.sampler_logprobs, plain.sampler_logprobs) and b.completions == plain.completions
    assert single.tool_mask is None and torch.equal(multi.tool_mask, plain.completion_mask)
    assert torch.equal(multi.loss_mask, plain.loss_mask) and plain.loss_mask is plain.completion_mask


@pytest.mark.parametrize("lean", [True, False])
def test_an_episode_split_into_turns_scores_as_one_pass(lean):
    """The sampler's log-prob of every model token, generated turn by turn (each turn prefilled from prompt +
    episode so far, observations appended between), equals log softmax(logits / T) of the whole episode scored
    in one forward pass (float64: only summation order differs)."""
    from grpo_dist.rollout import completion_logits
    model, tok = _model("float64")
    env = FixedObservationEnv(tok, max_turns=3, stop_ids=tuple(range(4, 30)))
    spec = _spec(tok, model, max_tokens=30)
    batch = env.rollout(_engine(model, tok, lean), tok, PROMPTS, ["19", "33", "18"], spec, 64, "cpu")
    obs = (batch.completion_mask - batch.tool_mask).sum()
    assert obs > 0 and batch.tool_mask.sum() > 0, "no observation was appended: the test shows nothing"
    counts = env.take_counts()
    assert counts["turns"] > counts["episodes"] and counts["observation_tokens"] == int(obs)
    with torch.no_grad():
        logp = torch.log_softmax(completion_logits(model, batch).double() / spec.temperature, -1)
        one_pass = logp.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    m = batch.loss_mask.bool()
    assert torch.allclose(one_pass[m], batch.sampler_logprobs.double()[m], atol=1e-6, rtol=0)  # fp32 storage
    assert (batch.sampler_logprobs[~batch.tool_mask.bool()] == 0).all()


def _tool_batch():
    """helpers.fixed_rollout with observation tokens in the middle of some completions."""
    from helpers import fixed_rollout
    batch, rewards = fixed_rollout()
    tool = batch.completion_mask.clone()
    for i in range(0, len(batch), 3):
        n = int(batch.completion_mask[i].sum())
        if n >= 5:
            tool[i, 2:n - 2] = 0
    batch.tool_mask = tool
    return batch, rewards


@pytest.mark.fast
@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_observation_log_probs_get_exactly_zero_gradient(loss_type):
    """d loss / d logp = 0 exactly at observation positions, != 0 at the model's tokens, for every loss type."""
    from grpo_dist.losses import LossSpec, grpo_loss
    batch, _ = _tool_batch()
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(batch.completion_ids.shape, generator=g) * 0.1 - 2).requires_grad_()
    ref = logp.detach() + torch.randn(logp.shape, generator=g) * 0.05
    adv = torch.randn(len(batch), generator=g)
    spec = LossSpec(loss_type=loss_type, epsilon=0.2, beta=0.04, max_completion_length=10)
    terms = grpo_loss(logp, logp.detach() + 0.01, adv, batch.loss_mask, normaliser=float(batch.loss_mask.sum()),
                      spec=spec, ref_logp=ref)
    terms.loss.backward()
    obs = (batch.completion_mask - batch.tool_mask).bool()
    assert obs.any() and (logp.grad[obs] == 0).all()
    assert (logp.grad[batch.loss_mask.bool()] != 0).any()


def test_the_trainer_trains_the_model_tokens_only(monkeypatch):
    """Through GRPOTrainer.learn: the gradient reaching the log-probs of observation tokens is exactly zero, and
    the token normaliser, trained_tokens, entropy and the sampler check count the model's tokens only."""
    import grpo_dist.learner as learner_mod
    import grpo_dist.trainer as trainer_mod
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    batch, rewards = _tool_batch()
    batch.sampler_logprobs = torch.zeros(batch.completion_ids.shape)
    cfg = load_config(None, EQUIV_BASE + ["loss_type=token_mean", "prompts_per_rank=4", "micro_batch_size=16",
                                          "output_dir=/tmp/unused_env_trainer"])
    tr = trainer_mod.GRPOTrainer(cfg, init_distributed(60))
    grads, masks, real = [], [], learner_mod.grpo_loss

    def recording(logp, old, adv, mask, **kwargs):
        logp.register_hook(lambda g: grads.append(g.detach().clone()))
        masks.append(mask.clone())
        return real(logp, old, adv, mask, **kwargs)
    monkeypatch.setattr(learner_mod, "grpo_loss", recording)
    layouts, real_layout = [], tr.learner.layout
    monkeypatch.setattr(tr.learner, "layout",
                        lambda cache, b, idx: layouts.append(real_layout(cache, b, idx)) or layouts[-1])
    m = tr.learn(batch, rewards)
    assert len(grads) == 1
    sub = layouts[-1][0]
    obs = (sub.completion_mask - sub.tool_mask).bool()
    assert obs.any() and (grads[0][obs] == 0).all() and (grads[0][sub.loss_mask.bool()] != 0).any()
    assert torch.equal(masks[0], sub.loss_mask)
    assert m["trained_tokens"] == float(batch.loss_mask.sum()) < float(batch.completion_mask.sum())


def test_an_environment_that_raises_ends_only_its_episodes(tmp_path):
    model, tok = _model()
    env = RaisingEnv(tok, max_turns=3, stop_ids=tuple(range(4, 30)))
    batch = env.rollout(_engine(model, tok), tok, PROMPTS, ["19", "boom", "18"], _spec(tok, model, max_tokens=160),
                        64, "cpu")
    c = env.take_counts()
    assert c["env_errors"] > 0 and c["episodes"] == len(batch) == 12
    for i in range(4, 8):  # the 'boom' prompt's rows: their last observation says what happened
        assert "environment error" in batch.completions[i] and "RuntimeError: environment bug" in batch.completions[i]
    assert not any("environment error" in batch.completions[i] for i in (0, 1, 2, 3, 8, 9, 10, 11))


def test_a_tool_call_past_max_turns_is_not_run_and_is_counted():
    model, tok = _model()
    env = ScriptedPythonEnv(tok, max_turns=1, stop_ids=tuple(range(4, 90)))
    batch = env.rollout(_engine(model, tok), tok, PROMPTS, ["19", "33", "18"], _spec(tok, model, max_tokens=160),
                        64, "cpu")
    c = env.take_counts()
    assert c["tool_calls"] == 0 and c["calls_after_max_turns"] == c["cut_max_turns"] > 0
    observed = (batch.completion_mask.sum(-1) > batch.tool_mask.sum(-1)).tolist()
    assert sum(observed) == c["calls_after_max_turns"]
    assert all("max_turns = 1 reached: this tool call was not run" in t for t, o in zip(batch.completions, observed)
               if o)


def _train_three_steps(rank, world_size, out_dir):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, EQUIV_BASE + [
        "prompts_per_rank=2", "max_completion_length=24",
        "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]", "max_steps=3", f"output_dir={out_dir}",
        "environment.env_class=tool_envs:ScriptedPythonEnv", "environment.max_turns=2", "save_steps=0",
        "save_final=false"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    out = [tr.train_step() for _ in range(3)]
    tr.close()
    return [{k: v for k, v in m.items() if k.startswith("tools/") or k in ("loss", "trained_tokens")} for m in out]


@pytest.mark.slow
def test_two_ranks_train_three_steps_with_executed_tool_calls(tmp_path):
    from dist_utils import run_ranks
    results = run_ranks(_train_three_steps, 2, tmp_path, str(tmp_path / "out"))
    assert results[0] == results[1]  # all-reduced: the same on every rank
    for m in results[0]:
        assert m["tools/calls"] >= 1 and m["tools/errors"] == 0 and m["tools/observation_tokens"] > 0
        assert m["trained_tokens"] > 0 and m["loss"] == m["loss"]

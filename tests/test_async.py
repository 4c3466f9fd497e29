"""Asynchronous GRPO (grpo_dist/async_rollout.py): at max_staleness 0, 1 trainer + 1 rollout rank give bitwise
the weights and optimizer state of 1 colocated rank; at max_staleness k > 0 the lag of every trained batch is
within k and the metrics say so; a rollout rank that dies ends the trainer within distributed.timeout_s with one
line naming it; bad settings are refused at start."""

import json
import math
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from dist_utils import free_port, run_ranks
from helpers import RESUME_BASE, async_rank, tensors_equal

STEPS = 3
BASE = [o for o in RESUME_BASE if not o.startswith(("max_steps", "report_to", "distributed.timeout_s"))] + \
    ["save_final=false", "report_to=[jsonl]", "distributed.timeout_s=60"]


def _train(rank, world_size, overrides, out_dir):
    from grpo_dist.async_rollout import PeerLost
    t0 = time.perf_counter()
    trainer, served = async_rank(BASE + overrides, out_dir)
    if trainer is None:
        return {"served": served}
    try:
        code = trainer.train()
    except PeerLost as e:
        return {"lost": str(e), "after_s": time.perf_counter() - t0}
    sd, osd = trainer.engine.gather_full_state()
    if rank != 0:
        return None
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {"code": code, "model": {k: v.clone() for k, v in sd.items()}, "optim": osd, "metrics": metrics}


@pytest.mark.slow
def test_staleness_0_one_trainer_one_rollout_rank_is_bitwise_colocated(tmp_path):
    steps = [f"max_steps={STEPS}"]
    colocated = run_ranks(_train, 1, tmp_path, steps, str(tmp_path / "colocated"))[0]
    asynchronous = run_ranks(_train, 2, tmp_path, steps + ["rollout_ranks=1", "max_staleness=0"],
                             str(tmp_path / "async"))
    assert asynchronous[1] == {"served": 0}  # the rollout rank ran to the stop header
    a = asynchronous[0]
    assert colocated["code"] == a["code"] == 0
    tensors_equal(colocated["model"], a["model"], "model")
    tensors_equal(colocated["optim"], a["optim"], "optimizer")
    # the runs must have learned something for the comparison to mean anything
    assert any(float(m["grad_norm"]) > 0 for m in colocated["metrics"])
    for c, m in zip(colocated["metrics"], a["metrics"]):
        assert c["reward_mean"] == m["reward_mean"] and c["loss"] == m["loss"]
        assert m["async/lag_max"] == 0 and m["async/dropped"] == 0
    # a version goes out before every batch: step 1 reports versions 0 and 1, step 2 version 2, the last none
    sent = [m["async/weight_sync_bytes"] for m in a["metrics"]]
    numel = sum(v.numel() for v in a["model"].values())  # fp32; the tiny model's tied head is sent once
    assert sent == [2 * sent[1], sent[1], 0] and 0 < sent[1] <= 4 * numel, (sent, numel)


@pytest.mark.slow
def test_staleness_0_two_trainers_two_rollout_ranks_is_bitwise_two_colocated(tmp_path):
    """FSDP over the trainer group (not the world), two rollout ranks each serving one trainer."""
    steps = ["max_steps=2", "prompts_per_rank=1"]
    colocated = run_ranks(_train, 2, tmp_path, steps, str(tmp_path / "colocated"))[0]
    asynchronous = run_ranks(_train, 4, tmp_path, steps + ["rollout_ranks=2"], str(tmp_path / "async"))
    assert asynchronous[2] == asynchronous[3] == {"served": 0}
    a = asynchronous[0]
    tensors_equal(colocated["model"], a["model"], "model")
    tensors_equal(colocated["optim"], a["optim"], "optimizer")
    assert [m["loss"] for m in colocated["metrics"]] == [m["loss"] for m in a["metrics"]]


@pytest.mark.slow
def test_staleness_k_bounds_the_lag_and_trains_decoupled_ppo(tmp_path):
    k, steps = 2, 4
    # nucleus + top-k sampling and GSPO's narrow window (3e-4): the case the old objective got wrong (the ratio
    # against filtered log-probs sat at the kept mass, below 1 - epsilon, and negative-advantage sequences were
    # clipped out)
    a = run_ranks(_train, 2, tmp_path, [f"max_steps={steps}", "rollout_ranks=1", f"max_staleness={k}",
                                        "num_iterations=1", "top_p=0.9", "top_k=20",
                                        "importance_sampling_level=sequence", "epsilon=3e-4", "epsilon_high=4e-4"],
                  str(tmp_path / "async"))[0]
    lags = [m["async/lag_max"] for m in a["metrics"]]
    # batch j is sampled with version max(0, j - k) and trains at step j: lag min(j, k), never above k
    assert lags == [min(j, k) for j in range(steps)]
    assert [m["async/lag_mean"] for m in a["metrics"]] == lags  # one batch per step on one trainer
    assert all(m["async/dropped"] == 0 for m in a["metrics"])
    # a version is sent once: no weights with the first k + 1 batches after the first, then every step
    sent = [m["async/weight_sync_bytes"] > 0 for m in a["metrics"]]
    assert sent == [j + k + 1 < steps for j in range(steps)]
    # decoupled PPO: the ratio is against the proximal policy (this step's weights, a no-grad pass): ~1 with one
    # iteration; the staleness shows in the sampler metrics and the behaviour weight proximal / sampler instead
    assert all(abs(m["ratio_mean"] - 1.0) < 1e-4 for m in a["metrics"])
    assert all(m["clip_fraction"] == 0.0 for m in a["metrics"])  # nothing clipped: every sequence has a gradient
    for m, lag in zip(a["metrics"], lags):
        assert "is_weight_mean" in m and "dual_clip_fraction" in m  # both on by default with stale rollouts
        if lag == 0:  # the sampler had the trainer's weights: only rounding apart (not the kept mass of top_p)
            assert m["sampler_logprob_diff"] < 1e-4 and abs(m["is_weight_mean"] - 1.0) < 1e-4
        else:  # sampled lag optimizer steps ago: the real gap (it read 0, and the weight 1, before)
            assert m["sampler_logprob_diff"] > 1e-4 and abs(m["is_weight_mean"] - 1.0) > 1e-4


def _features(tmp_path):
    """LoRA (adapter-only push), evaluation, dynamic sampling and SFT mixing in one run: a data file with a solution
    column (SFT), its first rows as the eval split."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a), "solution": f"={2 * a} so"})
                            + "\n" for a in range(8)))
    return [f"max_steps={STEPS}", "data.preset=null", f"data.path={data}", f"data.eval_path={data}",
            "data.eval_limit=4", "eval_steps=2", "lora.r=8", "lora.alpha=16", "dynamic_sampling=true",
            "dynamic_sampling_max_rounds=3", "sft_coef=0.5", "sft_field=solution", "sft_batch_size=2"]


@pytest.mark.slow
def test_lora_eval_dynamic_sampling_and_sft_train_asynchronously(tmp_path):
    """Every feature that async refused before (issue 38, item 7), in one 3-step run: at max_staleness 0 bitwise
    the colocated run (the rollout rank runs the colocated sample-and-grade, dynamic sampling's extra rounds come
    from the pipeline on the same weights), and at max_staleness 1 with the lag bounded; the LoRA push carries the
    adapters only."""
    features = _features(tmp_path)
    colocated = run_ranks(_train, 1, tmp_path, features, str(tmp_path / "colocated"))[0]
    k0 = run_ranks(_train, 2, tmp_path, features + ["rollout_ranks=1"], str(tmp_path / "k0"))
    k1 = run_ranks(_train, 2, tmp_path, features + ["rollout_ranks=1", "max_staleness=1"], str(tmp_path / "k1"))
    assert k0[1] == k1[1] == {"served": 0}
    a, b = k0[0], k1[0]
    assert colocated["code"] == a["code"] == b["code"] == 0
    tensors_equal(colocated["model"], a["model"], "model")
    tensors_equal(colocated["optim"], a["optim"], "optimizer")
    assert any(float(m["grad_norm"]) > 0 for m in colocated["metrics"])
    for c, m in zip(colocated["metrics"], a["metrics"]):
        for key in ("loss", "reward_mean", "dynamic_sampling_rounds", "sft_loss", "eval_accuracy"):
            assert c.get(key) == m.get(key), key
    assert "eval_accuracy" in a["metrics"][1] and "eval_accuracy" in b["metrics"][1]  # eval_steps=2: at step 2
    for m in b["metrics"]:
        assert m["async/lag_max"] <= 1 and m["async/dropped"] == 0 and m["dynamic_sampling_rounds"] >= 1
        assert "sft_loss" in m
    # adapter-only push: each version is the adapters' r x (d_in + d_out) per adapted layer in fp32, not the model
    adapters = sum(v.numel() for k, v in a["model"].items() if ".lora_A." in k or ".lora_B." in k)
    base = sum(v.numel() for k, v in a["model"].items() if ".lora_" not in k)
    assert a["metrics"][1]["async/weight_sync_bytes"] == 4 * adapters and 0 < adapters < base / 2, (adapters, base)


def _push_while_sampling(rank, world_size, busy_s):
    """Trainer rank 0 pushes versions 1 and 2 while rollout rank 1 samples (sleeps busy_s) with version 0, then 1."""
    import datetime

    import torch.distributed as dist

    from grpo_dist import async_rollout as ar
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    roles = ar.Roles(1, 1, rank, 30.0, None, None, dist.new_group([0, 1]), None, torch.device("cpu"))
    manifest = [("a", (3, 2), torch.float32), ("b", (5,), torch.bfloat16)]

    def weights(v):
        return [torch.full(shape, v + 0.25, dtype=dtype) for _, shape, dtype in manifest]
    if rank == 0:
        took = []
        for v in (1, 2):
            t0 = time.perf_counter()
            ar.push_version(v, iter(weights(v)), roles)
            took.append(time.perf_counter() - t0)
        ar.push_version(ar.STOP, iter(()), roles)
        return took
    receiver = ar.WeightReceiver(manifest, roles)
    same = []
    for v in (1, 2):
        time.sleep(busy_s)  # the batch in hand, sampled with version v - 1
        same += [torch.equal(t, w) for (_, t), w in zip(receiver.take(v), weights(v), strict=True)]
        receiver.release()
    receiver.join()
    return same


@pytest.mark.slow
def test_a_weight_push_does_not_wait_for_the_batch_in_hand(tmp_path):
    """The rollout rank receives version 1 into its second buffer while it samples with version 0: the push takes
    the transfer's time, not the batch's (before: the rollout rank took the weights only between batches, so the
    push lasted the rest of the batch). One version is staged at most: version 2 waits until version 1 is swapped
    in, at the end of the first batch. The weights arrive bitwise."""
    busy = 2.0
    took, same = run_ranks(_push_while_sampling, 2, tmp_path, busy, timeout=120)
    assert same == [True] * 4
    assert took[0] < busy / 2, took
    assert took[1] > busy / 2, took


def test_lag_acceptance_rule():
    from grpo_dist.async_rollout import accepted
    assert accepted(0, 0) and accepted(2, 2) and not accepted(3, 2) and not accepted(1, 0)
    assert not accepted(-1, 2)  # a version newer than the trainer's: a protocol error, never trained


def _kill_entry(rank, world_size, port, out_dir, overrides):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        result = _train(rank, world_size, overrides, os.path.join(out_dir, "run"))
    except BaseException:
        import traceback
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill"])  # "stop" (SIGSTOP): through train.main in test_async_faults.py
def test_a_rollout_rank_that_dies_or_hangs_ends_the_trainer_within_the_timeout(tmp_path, fault):
    timeout = 15
    env = os.environ.get("GRPO_DIST_FAULT")
    os.environ["GRPO_DIST_FAULT"] = f"{fault}@step2@rank1"
    try:
        ctx = mp.start_processes(_kill_entry, args=(2, free_port(), str(tmp_path),
                                                    ["max_steps=4", "rollout_ranks=1",
                                                     f"distributed.timeout_s={timeout}"]),
                                 nprocs=2, join=False, start_method="spawn")
    finally:
        os.environ.pop("GRPO_DIST_FAULT") if env is None else os.environ.update(GRPO_DIST_FAULT=env)
    deadline = time.time() + 180
    while ctx.processes[0].is_alive() and time.time() < deadline:
        time.sleep(0.5)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert "lost" in result, result.get("error")
    line = result["lost"]
    assert "\n" not in line
    assert line.startswith("rank 0 (trainer) waited up to 15 s") and "from rank 1" in line
    assert "the completions of batch 1" in line
    # step 1 trained, then one wait of at most the timeout (plus the start: models, the first step)
    assert result["after_s"] < timeout + 60


@pytest.mark.parametrize("overrides, key", [
    (["rollout_ranks=1", "max_staleness=1", "epsilon=inf"], "epsilon"),
    (["rollout_ranks=1", "max_staleness=2", "epsilon=1e9"], "epsilon"),
    (["rollout_ranks=1", "max_staleness=1", "epsilon=1.0"], "epsilon"),
    (["max_staleness=1"], "max_staleness"),
    (["rollout_ranks=-1"], "rollout_ranks"),
    (["rollout_ranks=1", "distributed.backend=deepspeed"], "distributed.backend"),
    (["rollout_ranks=1", "rollout_engine=vllm", "vllm.tensor_parallel_size=2"], "vllm.tensor_parallel_size"),
    (["rollout_ranks=1", "curriculum.num_generations_min=2", "curriculum.num_generations_max=6"],
     "curriculum.num_generations_min"),
    (["rollout_ranks=1", "curriculum.mode=online"], "curriculum.mode"),
])
def test_settings_that_cannot_apply_are_refused_at_start(overrides, key):
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + overrides)
    assert str(e.value).startswith(f"command line: config key '{key}'")
    assert "\n" not in str(e.value).split(" (and ")[0]


@pytest.mark.parametrize("k", [0, 1])
def test_filtered_sampling_is_accepted_at_any_staleness(k):
    """top_p / top_k: at max_staleness 0 no behaviour weight is used; above it the rollout ranks return the
    full distribution's log-probs (SamplingSpec.full_logprobs)."""
    from grpo_dist.config import load_config
    cfg = load_config(None, BASE + ["rollout_ranks=1", f"max_staleness={k}", "top_p=0.9", "top_k=20"])
    assert cfg.async_problems(2) == []


def test_filtered_sampler_logprobs_put_the_ratio_at_the_kept_mass():
    """Why the rollout ranks return full-distribution log-probs at max_staleness > 0: with the same weights,
    exp(logp_full - logp_filtered) for a kept token is the kept mass (sum over kept tokens of softmax(scores)),
    not 1, and a behaviour weight taken against the filtered log-probs would carry it."""
    from grpo_dist.rollout import _filter_scores, _token_logprobs
    torch.manual_seed(0)
    scores = torch.randn(4, 50) * 2
    filtered = _filter_scores(scores, 20, 0.9)
    token = filtered.argmax(-1)
    ratio = (_token_logprobs(scores, token) - _token_logprobs(filtered, token)).exp()
    kept_mass = torch.where(filtered.isfinite(), scores.softmax(-1), 0).sum(-1)
    torch.testing.assert_close(ratio, kept_mass)
    assert (ratio < 0.99).all()


@pytest.mark.parametrize("overrides, expected", [
    (["rollout_ranks=1", "max_staleness=1"], 3.0),          # stale rollouts: dual-clip on by default
    (["rollout_ranks=1", "max_staleness=1", "dual_clip_c=5"], 5.0),
    (["rollout_ranks=1"], None),                            # staleness 0 is synchronous GRPO: unchanged
    ([], None),
])
def test_dual_clip_is_on_by_default_with_stale_rollouts(overrides, expected):
    from grpo_dist.config import load_config
    assert load_config(None, BASE + overrides).effective_dual_clip_c == expected


def test_rollout_ranks_must_leave_a_trainer():
    from grpo_dist.config import load_config
    cfg = load_config(None, BASE + ["rollout_ranks=2"])
    assert cfg.async_problems(2)[0].startswith("config key 'rollout_ranks' = 2 leaves no trainer rank")
    assert cfg.async_problems(3) == []


@pytest.mark.fast
def test_decoupled_ppo_keeps_the_gradient_of_negative_advantage_sequences_under_gspo():
    """The objective at max_staleness > 0. A sampler whose log-probs sit above the trainer's (e.g. a filtered,
    renormalised distribution: each kept token's log-prob raised by -log(kept mass), here 0.05) puts GSPO's
    sequence ratio exp(mean(logp - behaviour)) = exp(-0.05) below 1 - epsilon (3e-4): clipped, so
    negative-advantage sequences got no gradient when the ratio was taken against the behaviour log-probs.
    Decoupled PPO clips around the proximal policy (the trainer's own log-probs before the update: ratio 1) and
    weights by proximal / behaviour: every sequence keeps its gradient."""
    from grpo_dist.losses import LossSpec, grpo_loss, truncated_is_weights
    torch.manual_seed(0)
    logp = (torch.rand(4, 6) * -2).requires_grad_()
    behaviour = logp.detach() + 0.05
    mask, adv = torch.ones(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    spec = LossSpec(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
    grpo_loss(logp, behaviour, adv, mask, normaliser=24.0, spec=spec).loss.backward()
    assert (logp.grad[adv < 0] == 0).all()  # the ratio against the behaviour log-probs: clipped away
    logp.grad = None
    proximal = logp.detach()
    weights = truncated_is_weights(proximal, behaviour, mask, "token", 2.0)
    grpo_loss(logp, proximal, adv, mask, normaliser=24.0, spec=spec, is_weights=weights).loss.backward()
    assert (logp.grad[adv < 0] != 0).all() and (logp.grad[adv > 0] != 0).all()
    torch.testing.assert_close(weights, torch.full_like(weights, math.exp(-0.05)))

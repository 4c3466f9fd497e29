"""The training-engine contract (grpo_dist.engines.Engine), checked the same way on every engine that runs here: local
(one process, in this one), FSDP on 2 gloo ranks, FSDP2 on 2 ranks (one unit, and a unit per layer) and on 1,
DeepSpeed ZeRO-2 and ZeRO-3 on 2 ranks (skipped without deepspeed). Each engine implements every abstract method;
its steps move the weights as torch's AdamW does on a plain copy of the model, with the same clipped global grad
norm (the same loss on every rank: gradients are averaged over ranks); current_lr follows warmup then cosine;
gather_full_state gives full tensors under the plain HF names; iter_full_weights / copy_weights_to give every
parameter; and the full state (plus save_engine_state, and the sharded format where supported) round-trips bitwise
and resumes with the same next step."""

import copy
import math

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE, VOCAB_HI, VOCAB_LO, need_deepspeed, tensors_equal

LR, WEIGHT_DECAY, WARMUP, MAX_STEPS = 1e-3, 0.1, 2, 5
BASE = EQUIV_BASE + [f"weight_decay={WEIGHT_DECAY}", f"warmup_steps={WARMUP}", "lr_scheduler_type=cosine",
                     f"max_steps={MAX_STEPS}", "num_iterations=1", "output_dir=/tmp/unused_engine_contract"]
ENGINES = {  # name: (ranks, overrides, the class build_engine must pick)
    "local": (1, ["distributed.backend=fsdp"], "LocalEngine"),
    "fsdp": (2, ["distributed.backend=fsdp"], "FSDPEngine"),
    "fsdp2": (2, ["distributed.backend=fsdp2"], "FSDP2Engine"),  # the tiny model as one unit (fsdp_wrap=auto)
    "fsdp2_layers": (2, ["distributed.backend=fsdp2", "distributed.fsdp_wrap=layer"], "FSDP2Engine"),
    "fsdp2_1_rank": (1, ["distributed.backend=fsdp2"], "FSDP2Engine"),
    "zero2": (2, ["distributed.backend=deepspeed", "distributed.zero_stage=2"], "DeepSpeedEngine"),
    "zero3": (2, ["distributed.backend=deepspeed", "distributed.zero_stage=3"], "DeepSpeedEngine"),
}
STEPS = 3  # checked against the reference (LR factors 0.5, 1, 1, then 0.75); then one around the save / load


def lr_factor(step: int) -> float:
    """The schedule written out: linear warmup over WARMUP steps, then cosine from 1 to 0 at MAX_STEPS."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (MAX_STEPS - WARMUP)))


def _loss(module, step: int) -> torch.Tensor:
    """Next-token cross-entropy on a batch fixed by the step, the same on every rank."""
    ids = torch.randint(VOCAB_LO, VOCAB_HI, (2, 8), generator=torch.Generator().manual_seed(step))
    logits = module(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _full_state(engine):
    """A copy of gather_full_state (its tensors may alias the live ones)."""
    return copy.deepcopy(engine.gather_full_state())


class Checks:
    """Failed checks, recorded rather than raised: collectives must stay in the same order on every rank."""

    def __init__(self):
        self.failures: list[str] = []

    def __call__(self, ok, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def same(self, a, b, what: str) -> None:
        try:
            tensors_equal(a, b, what)
        except AssertionError as e:
            self.failures.append(f"{what}: {e}")


def _failures(name: str, state_dir: str) -> list[str]:
    """The contract checks of one engine, on every rank."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines import build_engine
    from grpo_dist.models import load_model, load_tokenizer
    _, overrides, kind = ENGINES[name]
    cfg = load_config(None, BASE + overrides)
    ctx = init_distributed(120)
    model = load_model(cfg.model, load_tokenizer(cfg.model)).to(ctx.device)
    plain = copy.deepcopy(model).eval()  # the reference, stepped by torch's AdamW
    initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
    engine = build_engine(cfg, model, ctx)
    check = Checks()
    _check_class(check, engine, kind)
    _check_steps(check, engine, plain, cfg)
    saved = _full_state(engine)
    _check_full_state(check, saved, plain, initial, ctx.is_main)
    _check_full_weights(check, engine, plain, saved[0])
    _check_round_trips(check, engine, saved, state_dir)
    return check.failures


def _check_class(check: Checks, engine, kind: str) -> None:
    from grpo_dist.engines import Engine
    check(type(engine).__name__ == kind, f"build_engine built {type(engine).__name__}, not {kind}")
    check(isinstance(engine, Engine), "not an Engine")
    check(not type(engine).__abstractmethods__, f"abstract: {sorted(type(engine).__abstractmethods__)}")
    inherited = [m for m in sorted(Engine.__abstractmethods__) if getattr(type(engine), m) is getattr(Engine, m)]
    check(not inherited, f"abstract methods not implemented: {inherited}")


def _check_steps(check: Checks, engine, plain, cfg) -> None:
    """STEPS steps against torch's AdamW on the plain model (the same clipping, the LR of lr_factor): the same
    loss on every rank, so the engine's averaged gradients are the plain model's."""
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_epsilon, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        check(math.isclose(engine.current_lr(), LR * lr_factor(step), rel_tol=1e-9),
              f"step {step}: current_lr {engine.current_lr()} != {LR * lr_factor(step)}")
        engine.backward(_loss(engine.module, step))
        result = engine.step()
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_factor(step)
        _loss(plain, step).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad()
        check(result.applied and math.isclose(result.grad_norm, norm, rel_tol=1e-4),
              f"step {step}: {result} vs the plain model's grad norm {norm}")
    check(math.isclose(engine.current_lr(), LR * lr_factor(STEPS), rel_tol=1e-9), "current_lr after the steps")


def _check_full_state(check: Checks, saved, plain, initial: dict, is_main: bool) -> None:
    """Rank 0: full tensors under the plain names, with the plain model's stepped values; the others: nothing."""
    if not is_main:
        check(saved == (None, None), "a rank other than 0 got a full state")
        return
    model_state, optim_state = saved
    check(model_state is not None and optim_state is not None, "rank 0 got no full state")
    model_state, want = model_state or {}, plain.state_dict()
    check(set(model_state) == set(want), f"state keys differ: {sorted(set(model_state) ^ set(want))[:5]}")
    for key in sorted(set(model_state) & set(want)):
        got = model_state[key]
        if got.shape != want[key].shape or got.dtype != want[key].dtype:
            check(False, f"{key}: {tuple(got.shape)} {got.dtype}, not full {tuple(want[key].shape)}")
        elif not torch.allclose(got, want[key], rtol=0, atol=1e-6):
            check(False, f"{key}: off the plain AdamW's weights by {(got - want[key]).abs().max().item()}")
        elif key in initial and torch.equal(got, initial[key]):
            check(False, f"{key}: did not move")


def _check_full_weights(check: Checks, engine, plain, model_state: dict | None) -> None:
    """iter_full_weights: every parameter once, full, in the asked dtype; copy_weights_to writes exactly them."""
    weights = {n: t.clone() for n, t in engine.iter_full_weights()}
    params = dict(plain.named_parameters())
    check(set(weights) == set(params), f"iter_full_weights names differ: {sorted(set(weights) ^ set(params))[:5]}")
    check(all(weights[n].shape == p.shape for n, p in params.items() if n in weights), "iter_full_weights shapes")
    if model_state is not None:  # rank 0
        check.same({n: model_state[n] for n in weights if n in model_state}, weights, "iter_full_weights vs state")
    check({t.dtype for _, t in engine.iter_full_weights(torch.bfloat16)} == {torch.bfloat16}, "dtype not applied")
    replica = copy.deepcopy(plain)
    engine.copy_weights_to(replica)
    check.same(dict(replica.named_parameters()), weights, "copy_weights_to")


def _check_round_trips(check: Checks, engine, saved, state_dir: str) -> None:
    """Save (full state + save_engine_state + schedule, and the sharded format where supported), take a step,
    load: the state is the saved one bit for bit, and the same step again gives the same state."""
    engine.save_engine_state(state_dir)
    schedule, lr = copy.deepcopy(engine.scheduler_state()), engine.current_lr()
    if engine.supports_sharded():
        engine.save_sharded(f"{state_dir}/sharded")
    engine.backward(_loss(engine.module, STEPS))
    engine.step()
    after = _full_state(engine)
    loads = [("full", lambda: engine.load_full_state(*copy.deepcopy(saved)))]  # the engine may keep its tensors
    if engine.supports_sharded():
        loads.append(("sharded", lambda: engine.load_sharded(f"{state_dir}/sharded")))
    for how, load in loads:
        load()
        engine.load_engine_state(state_dir)
        engine.load_scheduler_state(copy.deepcopy(schedule))
        check.same(_full_state(engine), saved, f"{how} state after load")
        check(engine.current_lr() == lr, f"{how}: current_lr {engine.current_lr()} != {lr}")
        engine.backward(_loss(engine.module, STEPS))
        engine.step()
        check.same(_full_state(engine), after, f"{how}: the step after the load")


def _run(rank, world, names, state_dir):
    return {name: _failures(name, f"{state_dir}/{name}") for name in names}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks for FSDP and (with deepspeed) ZeRO-2 / ZeRO-3, in turn in the same processes."""
    names = ["fsdp", "fsdp2", "fsdp2_layers"]
    try:
        need_deepspeed()
        names += ["zero2", "zero3"]
    except pytest.skip.Exception:
        pass
    tmp = tmp_path_factory.mktemp("engine_contract")
    return run_ranks(_run, 2, tmp, names, str(tmp), timeout=600)


@pytest.mark.fast
@pytest.mark.usefixtures("one_thread")
def test_local_engine_keeps_the_contract(tmp_path):
    assert _run(0, 1, ["local"], str(tmp_path)) == {"local": []}


@pytest.mark.usefixtures("one_thread")
def test_one_rank_fsdp2_keeps_the_contract(tmp_path):
    assert run_ranks(_run, 1, tmp_path, ["fsdp2_1_rank"], str(tmp_path))[0] == {"fsdp2_1_rank": []}


@pytest.mark.slow  # 2 spawned ranks, the engines in turn
@pytest.mark.parametrize("name", ["fsdp", "fsdp2", "fsdp2_layers", "zero2", "zero3"])
def test_two_rank_engine_keeps_the_contract(two_ranks, name):
    if name not in two_ranks[0]:
        pytest.skip("deepspeed is not installed")
    assert [per_rank[name] for per_rank in two_ranks] == [[], []]

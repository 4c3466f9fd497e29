"""optimizer: adamw_8bit (grpo_dist/optim8bit.py, bitsandbytes' AdamW8bit).

The tiny model here has hidden_size 64, so its matrices (>= 4096 elements, bitsandbytes' min_8bit_size) really get
8-bit moments; each test checks that they did. On the fixed rollout of the equivalence tests: two steps are within
quantisation noise of torch's fp32 AdamW, 2 ranks (FSDP shards: other quantisation blocks) within that noise of 1
process, and a resume on 2 ranks (full checkpoint: the state gathered and re-sharded) and on 1 process is bitwise.
"""

import os

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE, G, PROMPTS, RESUME_BASE, checkpoint_state, fixed_rollout, tensors_equal

from grpo_dist.config import ConfigError, load_config

pytest.importorskip("bitsandbytes")

WIDE = ("model.tiny={architecture: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 128}")


@pytest.mark.fast
def test_settings_that_cannot_apply_are_refused_with_one_line(monkeypatch):
    # DeepSpeed: tried (docs/optimizers.md); the line says what was measured
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optimizer=adamw_8bit", "distributed.backend=deepspeed"])
    assert str(e.value).endswith("config key 'optimizer' = adamw_8bit is not supported with distributed.backend="
                                 "deepspeed (ZeRO hands it one flat fp32 partition per rank: biases and norms get "
                                 "8-bit moments in blocks shared with other parameters, measured 30 % off their "
                                 "1-process update); use distributed.backend=fsdp or fsdp2, or optimizer=adamw")
    assert len(e.value.problems) == 1
    # fsdp2 is built (the step on the DTensors' local shards: tests/test_adamw_8bit_fsdp2.py)
    assert load_config(None, ["optimizer=adamw_8bit", "distributed.backend=fsdp2"]).optimizer == "adamw_8bit"
    with pytest.raises(ConfigError, match="'optimizer' = 'adam8' is not allowed"):
        load_config(None, ["optimizer=adam8"])
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optimizer=adamw_8bit"])
    assert str(e.value).endswith("config key 'optimizer' = adamw_8bit needs bitsandbytes: pip install "
                                 "'grpo_dist[adamw8bit]'") and len(e.value.problems) == 1


def _eight_bit_shares(optimizer) -> float:
    """The fraction of this rank's parameter elements whose moments are 8-bit."""
    n8 = sum(p.numel() for p, st in optimizer.state.items() if st["state1"].dtype == torch.uint8)
    return n8 / max(sum(p.numel() for p in optimizer.state), 1)


def _two_steps(rank, world, names, steps=2):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(60)
    per_rank = PROMPTS // world
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    batch, rewards = fixed_rollout()
    out = {}
    for name in names:
        cfg = load_config(None, EQUIV_BASE + [WIDE, f"optimizer={name}", f"prompts_per_rank={per_rank}",
                                              "output_dir=/tmp/unused", "micro_batch_size=4"])
        tr = GRPOTrainer(cfg, ctx)
        for _ in range(steps):
            tr.learn(batch.rows(rows), rewards[rows])
        sd, _ = tr.engine.gather_full_state()
        share = _eight_bit_shares(tr.engine.optimizer) if name == "adamw_8bit" else 0.0
        if rank == 0:
            base = _initial_weights()
            out[name] = ({k: sd[k].clone() - base[k] for k in sd}, share)
    return out


def _initial_weights():
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, EQUIV_BASE + [WIDE])
    return load_model(cfg.model, load_tokenizer(cfg.model)).state_dict()


def _rel(a, b):
    """|a - b| / |b| over all tensors (the update vectors)."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    return (num / sum(float(b[k].double().pow(2).sum()) for k in b)) ** 0.5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_ranks(_two_steps, 1, tmp_path_factory.mktemp("one"), ["adamw", "adamw_8bit"], timeout=900)[0]


def test_two_steps_are_within_quantisation_noise_of_fp32_adamw(one_process):
    """Update of AdamW8bit vs torch AdamW after two steps (the second from quantised moments):
    |d8 - d32| / |d32| < 5 % (measured 2.1 %), and not 0 (the 8-bit moments are really in use: > 85 % of the
    elements)."""
    d32, _ = one_process["adamw"]
    d8, share = one_process["adamw_8bit"]
    assert share > 0.85
    assert 1e-4 < _rel(d8, d32) < 0.05, _rel(d8, d32)


@pytest.mark.slow  # 2 spawned gloo ranks: ~20 s
def test_two_ranks_are_within_quantisation_noise_of_one_process(one_process, tmp_path):
    """FSDP shards each matrix; the 256-element blocks then start elsewhere, so 2 ranks cannot be bitwise 1 process:
    the 2-rank update is within the noise 8-bit has against fp32 (|d2 - d1| / |d1| < 5 %; fp32 AdamW: 2e-6)."""
    two = run_ranks(_two_steps, 2, tmp_path, ["adamw_8bit"], timeout=900)[0]
    d2, share = two["adamw_8bit"]
    d1, _ = one_process["adamw_8bit"]
    assert share > 0.85
    assert _rel(d2, d1) < 0.05, _rel(d2, d1)


def _straight_and_resumed(rank, world, tmp):
    from helpers import no_dense_optimizer_state, resume_trainer
    base = [WIDE, "optimizer=adamw_8bit", f"prompts_per_rank={4 // world}", "max_steps=3", "save_steps=1"]
    tr = no_dense_optimizer_state(resume_trainer(base + [f"output_dir={tmp / 'a'}"]))
    assert tr.train() == 0
    share = _eight_bit_shares(tr.engine.optimizer)
    # b: from a's full checkpoint, writing sharded (DCP) ones; c: from b's sharded checkpoint-2, writing full ones
    tr = no_dense_optimizer_state(resume_trainer(base + [f"output_dir={tmp / 'b'}", "save_format=sharded",
                                                f"resume_from_checkpoint={tmp / 'a' / 'checkpoint-1'}"]))
    assert tr.train() == 0
    tr = no_dense_optimizer_state(resume_trainer(base + [f"output_dir={tmp / 'c'}",
                                                f"resume_from_checkpoint={tmp / 'b' / 'checkpoint-2'}"]))
    assert tr.train() == 0
    return share


@pytest.mark.slow  # 2 spawned gloo ranks, 3 + 2 + 1 steps: ~45 s
@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bitwise(tmp_path, world):
    """3 steps straight vs 1 step, a full checkpoint, 1 more step, a sharded (DCP) checkpoint, and 1 more from it:
    weights, optimizer state (codes, block scales: gathered from 2 ranks' FSDP shards and scattered back, or each
    rank's own in the DCP directory) and trainer state equal bit for bit; no save or load calls the optimizer's
    state_dict() (its dense layout is never built)."""
    assert RESUME_BASE  # the tiny trainer of the resume tests, widened
    share = run_ranks(_straight_and_resumed, world, tmp_path, tmp_path, timeout=900)[0]
    assert share > 0.85
    a = checkpoint_state(tmp_path / "a" / "checkpoint-3")
    b = checkpoint_state(tmp_path / "c" / "checkpoint-3")
    import torch.distributed.checkpoint as dcp

    from grpo_dist.optim8bit import sharded_holds_quantised
    metadata = dcp.FileSystemReader(str(tmp_path / "b" / "checkpoint-2" / "sharded")).read_metadata()
    assert sharded_holds_quantised(metadata.state_dict_metadata)  # each rank's codes and scales, not fp32 moments
    optim = a[1]["state"]
    assert any(st["q8_codes"].dtype == torch.uint8 and bool((st["q8_absmax"] >= 0).all())
               for st in optim.values())  # the 8-bit codes and scales were saved
    tensors_equal(a, b, f"world {world}")
    assert os.path.isfile(tmp_path / "c" / "checkpoint-3" / "optimizer.pt")


# ----------------------------------------------------------------------------------- quantised checkpoint state
def _cfg():
    from types import SimpleNamespace
    return SimpleNamespace(learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           weight_decay=0.01)


def _stepped(params, grads, steps=2):
    from grpo_dist.optim8bit import build_adamw_8bit
    opt = build_adamw_8bit(_cfg(), params)
    for s in range(steps):
        for p, g in zip(params, grads):
            p.grad = g * (s + 1)
        opt.step()
    return opt


@pytest.mark.fast
def test_checkpoint_state_is_the_codes_and_scales_and_resumes_bitwise():
    """One process: gather_full (what optimizer.pt holds) is bitsandbytes' codes (1 byte per moment) plus one
    fp32 scale and block start per 256 elements: < 2.2 bytes per parameter of an 8-bit matrix (the fp32 moments
    and per-element scales it replaced: 16). Loaded into a fresh optimizer: the same codes, scales and steps, and
    the next step equal bit for bit."""
    from grpo_dist.optim8bit import Q8, gather_full, load_full, nested_tensor_bytes
    torch.manual_seed(0)
    model = torch.nn.Linear(96, 100)  # weight 9600 elements (8-bit: 37 blocks, the last short), bias 100 (fp32)
    grads = [torch.randn_like(p) for p in model.parameters()]
    opt = _stepped(list(model.parameters()), grads)
    sd = gather_full(model, opt)
    weight = sd["state"]["weight"]
    assert weight[Q8].dtype == torch.uint8 and weight[Q8].shape == (2, 100, 96)
    assert nested_tensor_bytes(weight) / 9600 < 2.2 and \
        nested_tensor_bytes(opt.state_dict()["state"][0]) / 9600 == 16.0 + 4 / 9600
    assert weight["q8_block_start"].tolist() == list(range(0, 9600, 256))
    assert float(sd["state"]["bias"]["q8_absmax"][0, 0]) == -1  # bias: kept fp32 moments, exact
    twin = torch.nn.Linear(96, 100)
    twin.load_state_dict(model.state_dict())
    fresh = _stepped(list(twin.parameters()), grads, steps=0)
    load_full(twin, fresh, torch.load(_saved(sd), weights_only=False), broadcast=False)
    for p, q in zip(model.parameters(), twin.parameters()):
        tensors_equal(fresh.state[q], opt.state[p], "loaded state")
    for o, m in ((opt, model), (fresh, twin)):
        for p, g in zip(m.parameters(), grads):
            p.grad = g
        o.step()
    tensors_equal(dict(twin.named_parameters()), dict(model.named_parameters()), "the step after the load")


def _saved(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.fast
def test_quantised_state_moves_between_shard_layouts():
    """FSDP1's flat shards cut a parameter anywhere: 2 'ranks' hold elements [0, 5000) (8-bit, blocks from 0) and
    [5000, 8192) (3192 < 4096 elements: fp32 moments). Merged, the state loads back into each half bit for bit;
    into the whole parameter (1 rank) it is the moments qmap[code] x scale of the first half's blocks and the
    second half's fp32 values, quantised afresh; optimizer=adamw takes those moments (dequantised)."""
    from grpo_dist.optim8bit import QMAP, _merge, _segment, dequantised, dequantised_range, native_from_quantised
    torch.manual_seed(1)
    full, grad = torch.randn(64, 128), torch.randn(64, 128)
    halves = [torch.nn.Parameter(full.flatten()[a:b].clone()) for a, b in ((0, 5000), (5000, 8192))]
    opt = _stepped(halves, [grad.flatten()[:5000], grad.flatten()[5000:]])
    st0, st1 = opt.state[halves[0]], opt.state[halves[1]]
    assert st0["state1"].dtype == torch.uint8 and st1["state1"].dtype == torch.float32
    qmaps = torch.stack([st0["qmap1"], st0["qmap2"]]).float()
    q = torch.load(_saved(_merge([_segment(st1, 5000), None, _segment(st0, 0)], full.shape)),
                   weights_only=False)
    for p, offset in zip(halves, (0, 5000)):  # the same layout: bitwise
        tensors_equal(native_from_quantised(opt, q, qmaps, p, offset), opt.state[p], f"half at {offset}")
    m, v = dequantised_range(q, qmaps, 0, 8192)
    scale1 = st0["absmax1"].repeat_interleave(256)[:5000]
    scale2 = st0["absmax2"].repeat_interleave(256)[:5000]
    torch.testing.assert_close(m, torch.cat([st0["qmap1"][st0["state1"].long()] * scale1, st1["state1"]]),
                               rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([st0["qmap2"][st0["state2"].long()] * scale2, st1["state2"]]),
                               rtol=0, atol=0)
    whole = torch.nn.Parameter(full.clone())
    one = _stepped([whole], [grad], steps=0)
    st = native_from_quantised(one, q, qmaps, whole, 0)  # another layout: quantised afresh from those moments
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() == 32
    again = st["qmap1"][st["state1"].long()].flatten() * st["absmax1"].repeat_interleave(256)
    assert float((again - m).abs().max()) <= 0.02 * float(m.abs().max())
    dense = dequantised({"state": {"w": q}, "param_groups": [], QMAP: qmaps}, [])["state"]["w"]
    assert dense["exp_avg"].shape == full.shape and torch.equal(dense["exp_avg_sq"].flatten(), v)


def _older_checkpoints(rank, world, tmp):
    """One process: a sharded checkpoint in the fp32-moment layout adamw_8bit wrote before (get_state_dict's, as
    _legacy_sharded_state writes it) and a quantised one; what adamw_8bit and adamw make of each."""
    import torch.distributed.checkpoint as dcp

    from grpo_dist.distributed import init_distributed
    from grpo_dist.optim8bit import QMAP, dequantised_range
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(60)
    batch, rewards = fixed_rollout()

    def trainer(name):
        return GRPOTrainer(load_config(None, EQUIV_BASE + [WIDE, f"optimizer={name}", f"prompts_per_rank={PROMPTS}",
                                                           "output_dir=/tmp/unused", "micro_batch_size=4"]), ctx)
    tr = trainer("adamw_8bit")
    tr.learn(batch, rewards)
    dcp.save(tr.engine._legacy_sharded_state(), checkpoint_id=str(tmp / "legacy"))
    tr.engine.save_sharded(tmp / "quantised")
    names = {id(p): n for n, p in tr.engine.module.named_parameters()}
    want = {names[id(p)]: st for p, st in tr.engine.optimizer.state.items()}
    again = trainer("adamw_8bit")
    again.engine.load_sharded(tmp / "legacy")  # fp32 moments and per-element scales: codes and scales recovered
    got = {n: again.engine.optimizer.state[p] for n, p in again.engine.module.named_parameters()}
    assert set(got) == set(want)
    for n, st in got.items():  # a block of scale 0 (embedding rows no token used) is zeros under any code
        tensors_equal(_moments(st), _moments(want[n]), f"from the fp32-moment layout: {n}")
    plain = trainer("adamw")
    with pytest.raises(ValueError) as e:
        plain.engine.load_sharded(tmp / "quantised")
    message = str(e.value)
    model_sd, optim_sd = tr.engine.gather_full_state()
    plain.engine.load_full_state(model_sd, optim_sd)  # optimizer=adamw from the quantised full state: dequantised
    q, p = optim_sd["state"]["model.layers.0.mlp.up_proj.weight"], plain.engine.module.model.layers[0].mlp.up_proj
    m, v = dequantised_range(q, optim_sd[QMAP], 0, p.weight.numel())
    st = plain.engine.optimizer.state[p.weight]
    return message, torch.equal(st["exp_avg"].flatten(), m), torch.equal(st["exp_avg_sq"].flatten(), v)


def _moments(st: dict) -> dict:
    """A bitsandbytes state as the moments its step reads (qmap[code] x block scale), its scales and step."""
    if st["state1"].dtype != torch.uint8:
        return st
    out = {"step": st["step"], "absmax1": st["absmax1"], "absmax2": st["absmax2"]}
    for k in ("1", "2"):
        scale = st[f"absmax{k}"].repeat_interleave(256)[:st[f"state{k}"].numel()]
        out[f"moment{k}"] = st[f"qmap{k}"][st[f"state{k}"].long()].flatten() * scale
    return out


@pytest.mark.slow  # 1 spawned process: ~10 s
def test_older_and_other_optimizer_checkpoints(tmp_path):
    """adamw_8bit loads its earlier sharded layout (fp32 moments + per-element scales): the same moments, scales and
    steps (codes too, but in blocks of scale 0, where every code means 0); optimizer=adamw
    takes a quantised full state as its dequantised moments (qmap[code] x block scale) and refuses a quantised
    sharded one with one line naming why."""
    message, m_equal, v_equal = run_ranks(_older_checkpoints, 1, tmp_path, tmp_path, timeout=600)[0]
    assert message == (f"{tmp_path / 'quantised'} holds optimizer=adamw_8bit's quantised optimizer state, which "
                       "optimizer=adamw cannot load from a sharded checkpoint; resume with optimizer=adamw_8bit")
    assert m_equal and v_equal


# ------------------------------------------------------------------------------------- another world size
# one layer whose flat parameter 2 FSDP ranks cut inside up_proj, 6176 elements in (not a multiple of the 256-element
# block) with >= 4096 (bitsandbytes' min_8bit_size) on each side: both halves keep 8-bit codes in blocks that do not
# line up with one process's
CUT = ("model.tiny={architecture: qwen2, hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 4, "
       "num_key_value_heads: 2, intermediate_size: 384}")

def _gathered_moments(engine) -> dict | None:
    """{name: (step, exp_avg, exp_avg_sq)} of the engine's state as the 8-bit step reads it (qmap[code] x block
    scale; fp32 moments as they are), gathered to rank 0 (None elsewhere). Collective."""
    from grpo_dist.optim8bit import Q8, QMAP, dequantised_range
    _, optim_sd = engine.gather_full_state()
    if optim_sd is None:
        return None
    out = {}
    for name, q in optim_sd["state"].items():
        m, v = dequantised_range(q, optim_sd[QMAP], 0, q[Q8].shape[1:].numel())
        out[name] = (int(q["step"]), m, v)
    return out


def _save_at(rank, world, tmp, fmt):
    """2 steps at this world size (global batch 4), checkpoint-2 in format fmt; the state written, as moments."""
    from helpers import resume_trainer
    tr = resume_trainer([CUT, "optimizer=adamw_8bit", f"prompts_per_rank={4 // world}", "max_steps=2",
                         "save_steps=2", f"save_format={fmt}", f"output_dir={tmp / 'saved'}"])
    assert tr.train() == 0
    return _gathered_moments(tr.engine), _eight_bit_shares(tr.engine.optimizer)


def _resume_at(rank, world, tmp):
    """checkpoint-2 resumed at this world size: the moments loaded, then one more step."""
    from helpers import resume_trainer
    tr = resume_trainer([CUT, "optimizer=adamw_8bit", f"prompts_per_rank={4 // world}", "max_steps=3",
                         "save_steps=0", f"resume_from_checkpoint={tmp / 'saved' / 'checkpoint-2'}",
                         f"output_dir={tmp / 'resumed'}"])
    loaded = _gathered_moments(tr.engine)
    assert tr.train() == 0
    return loaded, tr.step, _eight_bit_shares(tr.engine.optimizer)


@pytest.mark.slow  # 3 + 3 spawned gloo processes, 2 + 1 steps each way: ~60 s
@pytest.mark.parametrize("saved_world,resumed_world,fmt", [(2, 1, "sharded"), (1, 2, "full")])
def test_a_checkpoint_resumes_at_another_world_size(tmp_path, saved_world, resumed_world, fmt):
    """FSDP cuts each matrix elsewhere at another world size, so the 256-element blocks of the saved codes no longer
    line up with the new shards: the loaded moments are the saved ones (qmap[code] x block scale) quantised afresh
    in the new blocks. Each moment is then within one code step of what was saved (|loaded - saved| <= 2 % of the
    parameter's largest moment, the code book's coarsest step near its top), the steps are the saved ones, the
    fp32 moments of small tensors are exact, and the run trains on."""
    saved, share = run_ranks(_save_at, saved_world, tmp_path, tmp_path, fmt, timeout=900)[0]
    loaded, step, share_after = run_ranks(_resume_at, resumed_world, tmp_path, tmp_path, timeout=900)[0]
    assert share > 0.85 and share_after > 0.85  # matrices really had 8-bit moments, before and after
    assert step == 3 and set(loaded) == set(saved)
    moved = set()
    for name, (s_step, s_m, s_v) in saved.items():
        l_step, l_m, l_v = loaded[name]
        assert l_step == s_step == 4, name  # 2 steps of num_iterations=2 (RESUME_BASE)
        for saved_moment, loaded_moment in ((s_m, l_m), (s_v, l_v)):
            top = float(saved_moment.abs().max())
            diff = float((loaded_moment - saved_moment).abs().max())
            assert diff <= 0.02 * top, f"{name}: {diff} > 2 % of {top}"
            if diff > 0:
                moved.add(name)
    # the blocks did move (re-quantised, not copied: else this tests nothing), where the ranks cut the layer
    assert "model.layers.0.mlp.up_proj.weight" in moved, moved

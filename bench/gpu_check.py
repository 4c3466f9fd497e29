"""Driver of bench/gpu_check.sh: one subcommand per stage, each printing `RESULT {json}` lines and `CHECK ...` verdicts.

    python bench/gpu_check.py build --root DIR
    torchrun --standalone --nproc_per_node 1 bench/gpu_check.py train --model DIR --out DIR --format sharded
    python bench/gpu_check.py evaluate --model CHECKPOINT --out DIR
    python bench/gpu_check.py meta --model DIR --out DIR      # the trainer as rank 1 of a pretend 2-rank world
    python bench/gpu_check.py decode                          # lean decoder ms/step at 0.5B and 7B shapes
    python bench/gpu_check.py learn --out DIR                 # the built-in demo trained on this device, 1 rank
    python bench/gpu_check.py long --model DIR --out DIR      # one step, long-tailed completions up to 1024 tokens
    python bench/gpu_check.py async --model DIR               # 1 trainer + 1 rollout rank on the one GPU, k = 0, 1
    python bench/gpu_check.py summary RESULTS.jsonl           # or the folder / gpu_check.tgz that holds it

Models are random-init Qwen2 shapes built from configs (nothing is downloaded): Qwen2.5-0.5B (24 layers, hidden 896,
vocab 151,936, tied embeddings) and a 4-layer slice of it (tied and untied). GPU_CHECK_SMOKE=1 shrinks every shape
and length so that the whole check runs on a CPU in about a minute (the same code paths, gloo instead of nccl).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import string
import sys
import time
from pathlib import Path

import torch

SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
CUDA = torch.cuda.is_available()
GIB = 2 ** 30

QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
              rms_norm_eps=1e-6, max_position_embeddings=32768)
if SMOKE:
    QWEN05 = dict(QWEN05, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512)
SHAPES = {"qwen05": QWEN05,
          "qwen05_4l": dict(QWEN05, num_hidden_layers=min(4, QWEN05["num_hidden_layers"])),
          "qwen05_4l_untied": dict(QWEN05, num_hidden_layers=min(4, QWEN05["num_hidden_layers"]),
                                   tie_word_embeddings=False)}
# The 0.5B config's per-rank work (8 prompts x 8 completions), with completions short enough for the time budget.
WORK = dict(prompts_per_rank=8, num_generations=8, max_completion_length=256, micro_batch_size=8)
if SMOKE:
    WORK = dict(prompts_per_rank=2, num_generations=4, max_completion_length=8, micro_batch_size=4)
PROMPT = ("Solve the arithmetic problem below. Work step by step, check each digit, and end with the final number "
          "alone on the last line.\nProblem: {prompt}")


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw, default=str), flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if CUDA else None


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------------------------------ build
def make_tokenizer(vocab: int):
    """One token per printable character for prompts, plus ordinary (not special) word tokens up to `vocab`, so that
    every id a random model samples decodes to text and text-based rewards vary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    words = [f"<w{i}>" for i in range(vocab - len(specials) - len(chars))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="left")


def cmd_build(a) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    for kind in a.kinds.split(","):
        t0 = time.perf_counter()
        spec = SHAPES[kind]
        tok = make_tokenizer(spec["vocab_size"])
        ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**spec, **ids))
        model.generation_config = GenerationConfig(**ids)
        out = Path(a.root) / kind
        model.save_pretrained(out)
        tok.save_pretrained(out)
        result(stage="build", kind=kind, params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
               tied=spec["tie_word_embeddings"], seconds=round(time.perf_counter() - t0, 1))
        del model
        gc.collect()


# ------------------------------------------------------------------------------------------------------ train
def make_config(model_dir: str, out_dir: Path, **over):
    import yaml
    from grpo_dist.config import load_config
    d = dict(output_dir=str(out_dir), seed=0, max_steps=3, save_steps=0, save_final=False, report_to=["jsonl"],
             progress_bar=False, eval_steps=0, log_completions=2,
             model=dict(name_or_path=model_dir, dtype="float32", attn_implementation="sdpa"),
             data=dict(preset="arithmetic", prompt_template=PROMPT, max_prompt_length=256, eval_limit=16),
             temperature=1.0, rewards=[dict(function="gpu_check_rewards:char_parity", weight=1.0)],
             reward_workers=0, beta=0.04, learning_rate=1e-5, max_grad_norm=1.0,
             distributed=dict(backend="fsdp", sharding_strategy="FULL_SHARD", mixed_precision="bf16"), **WORK)
    for k, v in over.items():
        d[k] = dict(d[k], **v) if isinstance(v, dict) else v
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check_config.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return load_config(str(path))


class Phases:
    """Wall time (GPU synchronised) and peak GPU memory of each call of the trainer's phases."""

    def __init__(self, trainer):
        self.calls: dict[str, list[dict]] = {}
        # the step's stages where they live (trainer.py): rollout = the batch source's next_batch (weight sync,
        # sampling and grading), learn = advantage to update and the step's metrics
        for name, owner, attr in (("rollout", trainer.source, "next_batch"), ("learn", trainer, "_learn"),
                                  ("save", trainer, "save"), ("evaluate", trainer, "evaluate")):
            self._wrap(owner, attr, name)

    def _wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            sync()
            reset_peak()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.calls.setdefault(name, []).append(dict(s=time.perf_counter() - t0, peak_gib=peak_gib()))
            return out
        setattr(owner, attr, timed)

    def report(self, run: str) -> None:
        for name, calls in self.calls.items():
            peaks = [c["peak_gib"] for c in calls if c["peak_gib"] is not None]
            result(stage="phase", run=run, phase=name, calls=len(calls),
                   median_s=round(statistics.median(c["s"] for c in calls), 3),
                   peak_gib=max(peaks) if peaks else None)


def new_trainer(cfg, ctx):
    from grpo_dist.trainer import GRPOTrainer
    sync()
    reset_peak()
    t0 = time.perf_counter()
    tr = GRPOTrainer(cfg, ctx)
    sync()
    result(stage="init", run=Path(cfg.output_dir).name, seconds=round(time.perf_counter() - t0, 1),
           engine=type(tr.engine).__name__, save_format=tr.save_format, resumed_from=str(tr.checkpointer.resumed_from),
           peak_gib=peak_gib())
    return tr


def run_steps(tr, upto: int, run: str, save_at: int | None = None) -> list[dict]:
    rows = []
    while tr.step < upto:
        m = tr.train_step()
        if tr.cfg.eval_steps and tr.step % tr.cfg.eval_steps == 0:
            m.update(tr.evaluate())
        train_tokens = (m["completion_length_mean"] + m["prompt_length_mean"]) * len(tr.last_step.advantages)
        row = dict(stage="step", run=run, step=tr.step, step_time_s=round(m["step_time_s"], 3),
                   rollout_s=round(m["time_rollout_s"], 3), logprobs_s=round(m["time_logprobs_s"], 3),
                   update_s=round(m["time_update_s"], 3),
                   rollout_tokens_per_s=round(m["completion_tokens_per_s"], 1),
                   train_tokens_per_s=round(train_tokens / max(m["time_logprobs_s"] + m["time_update_s"], 1e-9), 1),
                   loss=m["loss"], kl=m["kl"], grad_norm=m["grad_norm"], eval_accuracy=m.get("eval_accuracy"),
                   mfu=m.get("mfu"), mfu_update=m.get("mfu_update"), mfu_logprobs=m.get("mfu_logprobs"),
                   peak_gib=peak_gib())
        result(**row)
        rows.append(row)
        if save_at and tr.step == save_at:
            tr.save(background=tr.checkpointer.saver is not None)  # as the training loop saves (async_save)
    saver = tr.checkpointer.saver
    if saver is not None and saver.in_flight():  # in place before anything resumes from it
        result(stage="save", run=run, **{k: round(v, 3) for k, v in tr.checkpointer.save_times(wait=True).items()})
    return rows


def full_weights(tr) -> dict:
    state, _ = tr.engine.gather_full_state()  # rank 0 (the only rank here) gets the full fp32 weights
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def close(tr) -> None:
    with contextlib.suppress(Exception):
        tr.rewards.close()
        tr.logger.close()
        tr.completion_log.close()
    del tr
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def cmd_train(a) -> None:
    """Steps with per-phase time and peak, a save at --save-at in --format, then a fresh trainer resumes from it and
    runs the remaining steps; the weights are compared with the uninterrupted run's."""
    from grpo_dist import distributed as gdist
    ctx = gdist.init_distributed(600)
    out = Path(a.out)
    cfg = make_config(a.model, out / "run", save_format=a.format, eval_steps=a.eval_steps)
    tr = new_trainer(cfg, ctx)
    phases = Phases(tr)
    rows = run_steps(tr, a.steps, "continuous", save_at=a.save_at)
    phases.report(f"{Path(a.model).name}/{a.format}")
    ref = full_weights(tr)
    close(tr)
    ck = out / "run" / f"checkpoint-{a.save_at}"
    cfg2 = make_config(a.model, out / "resumed", save_format=a.format, eval_steps=a.eval_steps,
                       resume_from_checkpoint=str(ck))
    try:
        tr2 = new_trainer(cfg2, ctx)
    except Exception as e:  # noqa: BLE001 - reported as the stage's verdict
        print(f"CHECK resume from {ck.name} ({a.format}): FAILED at start: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]}", flush=True)
        result(stage="resume", format=a.format, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        raise SystemExit(1) from None
    rows2 = run_steps(tr2, a.steps, "resumed")
    got = full_weights(tr2)
    diff = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    same_loss = rows[-1]["loss"] == rows2[-1]["loss"]
    print(f"CHECK resume from {ck.name} ({a.format}): step {a.steps} loss equal: {same_loss}; max |weight "
          f"difference| {diff:.3g}", flush=True)
    result(stage="resume", format=a.format, ok=True, last_loss_equal=same_loss, max_weight_diff=diff)
    close(tr2)
    gdist.cleanup()


# ------------------------------------------------------------------------------------------------------ evaluate
def cmd_evaluate(a) -> None:
    """grpo_dist.tools.evaluate's CLI on a saved checkpoint (generation in the compute dtype), timed, with its peak."""
    from grpo_dist.tools import evaluate
    cfg_path = Path(a.model).parent / "gpu_check_config.yaml"
    reset_peak()
    t0 = time.perf_counter()
    code = evaluate.main(["--model", a.model, "--config", str(cfg_path), "--limit", str(a.limit),
                          "--output", str(Path(a.out) / "eval.json")])
    sync()
    res = json.loads((Path(a.out) / "eval.json").read_text()) if code == 0 else {}
    result(stage="evaluate", ok=code == 0, seconds=round(time.perf_counter() - t0, 1), problems=res.get("num_examples"),
           accuracy=res.get("accuracy"), peak_gib=peak_gib())
    if code != 0:
        raise SystemExit(code)


# ------------------------------------------------------------------------------------------------------ meta
def cmd_meta(a) -> None:
    """The real trainer as rank 1 of a 2-rank world, in one process: pretrained weights on several ranks make every
    rank but 0 build the model on the meta device and get storage (and, on CUDA, rank 0's values) while FSDP wraps
    (param_init_fn + sync_module_states). One process cannot receive rank 0's values, so the weights stay
    uninitialised (the loss may be nan); the check is that nothing is left off the device and a step runs."""
    from grpo_dist import distributed as gdist
    from grpo_dist.models import misplaced_tensors
    real = gdist.init_distributed(600)
    ctx = gdist.DistContext(rank=1, world_size=2, local_rank=real.local_rank, device=real.device,
                            backend=real.backend)
    cfg = make_config(a.model, Path(a.out) / "meta", max_steps=1)
    tr = new_trainer(cfg, ctx)
    models = {"gen_model": tr.gen_model, "policy": tr.engine.module, "reference": tr.ref_model}
    bad = {k: misplaced_tensors(m, ctx.device) for k, m in models.items() if isinstance(m, torch.nn.Module)}
    n_bad = sum(map(len, bad.values()))
    print(f"CHECK meta rank 1 of 2 on {ctx.device}: {n_bad} tensors off the device"
          + "".join(f"; {k}: {v[:3]}" for k, v in bad.items() if v), flush=True)
    m = tr.train_step()
    print(f"CHECK meta step ok: loss {m['loss']}, rollout {m['time_rollout_s']:.2f}s", flush=True)
    result(stage="meta", device=str(ctx.device), misplaced=n_bad, examples=[x for v in bad.values() for x in v][:8],
           loss=m["loss"], step_time_s=round(m["step_time_s"], 3), peak_gib=peak_gib())
    close(tr)
    gdist.cleanup()
    if n_bad:
        raise SystemExit(1)


# ------------------------------------------------------------------------------------------------------ decode
# (name, overrides of QWEN05, row counts). 1.5B: Qwen2.5-1.5B's shape (28 layers, hidden 1536, 2 kv heads); 7B:
# Qwen2.5-7B's (28 layers, hidden 3584, 4 kv heads).
DECODE_SHAPES = [("0.5b", {}, (64, 256)),
                 ("1.5b", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               intermediate_size=8960), (64,)),
                 ("7b", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                             intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False), (32, 128))]
DECODE_LENGTHS = dict(prompt=200, new=260, warmup=50, timed=200)
if SMOKE:  # the same code on a CPU: shapes a few MB big
    DECODE_SHAPES = [("0.5b", {}, (2, 4)),
                     ("7b", dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                                 intermediate_size=160, tie_word_embeddings=False), (2,))]
    DECODE_LENGTHS = dict(prompt=12, new=12, warmup=2, timed=6)


def decode_floor_ms(weight_bytes: int, kv_bytes: float, gb_per_s: float) -> tuple[float, float]:
    """The bandwidth floor of one decode step: every weight is read once per step (and, second figure, the KV cache
    up to the current position as well) at the device's memory bandwidth."""
    return weight_bytes / (gb_per_s * 1e9) * 1e3, (weight_bytes + kv_bytes) / (gb_per_s * 1e9) * 1e3


def _decode_run(model, B: int, mode: str, dev) -> tuple[float, list[torch.Tensor]]:
    """ms per decode step of one decoder mode (eager | graphs; graphs are captured in the warm-up steps) and the
    logits of the first warm-up steps, each step fed the previous step's greedy token."""
    from grpo_dist.decoder import LeanDecoder
    L = DECODE_LENGTHS
    dec = LeanDecoder(model, cuda_graphs=mode == "graphs", capture=CUDA)  # CPU smoke: the static step, uncaptured
    g = torch.Generator().manual_seed(0)
    x = torch.randint(9, min(500, model.config.vocab_size), (B, L["prompt"]), generator=g).to(dev)
    first = []
    with torch.inference_mode():
        logits = dec.prefill(x, torch.ones_like(x), None, L["new"])
        for i in range(L["warmup"] + L["timed"]):
            if i == L["warmup"]:
                sync()
                t0 = time.perf_counter()
            y = logits.argmax(-1)
            logits = dec.step(y)
            if i < 8:
                first.append(logits.float().cpu())
        sync()
    return (time.perf_counter() - t0) / L["timed"] * 1e3, first


def cmd_decode(a) -> None:
    """ms per decode step of the lean decoder (decoder.LeanDecoder: prefill, then step per token, greedy) on random
    bf16 weights, eager and from CUDA graphs (lean_cuda_graphs), against the weight-bandwidth floor (a decode step
    reads every weight once). A step far above the floor at small row counts is launch-bound (host time per kernel),
    not bandwidth-bound. The graphs' first 8 steps' logits are compared with the eager ones (greedy tokens equal)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_dist.decoder import prepare_replica
    dev = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32  # bf16 matmuls on a CPU are slow and say nothing
    L = DECODE_LENGTHS
    for name, over, rows in DECODE_SHAPES:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**{**QWEN05, **over}), dtype=dtype).eval()
        prepare_replica(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cfg = model.config
        for B in rows:
            # K and V of every layer up to the mean position of the timed steps
            mean_pos = L["prompt"] + L["warmup"] + L["timed"] / 2
            kv_bytes = (2 * cfg.num_hidden_layers * B * cfg.num_key_value_heads * mean_pos
                        * (cfg.hidden_size // cfg.num_attention_heads) * torch.finfo(dtype).bits / 8)
            floor, floor_kv = decode_floor_ms(weight_bytes, kv_bytes, a.gb_per_s)
            runs = {}
            for mode in ("eager", "graphs") if CUDA or SMOKE else ("eager",):
                reset_peak()
                ms, first = _decode_run(model, B, mode, dev)
                runs[mode] = first
                print(f"CHECK decode {name} {B} rows {mode}: {ms:.2f} ms/step; floor {floor:.3g} ms (weights "
                      f"{weight_bytes / GIB:.3g} GiB at {a.gb_per_s:g} GB/s), {floor_kv:.3g} ms with the KV cache; "
                      f"{ms / floor:.1f}x the floor, {B / ms * 1e3:.0f} tokens/s", flush=True)
                result(stage="decode", shape=name, rows=B, mode=mode, ms_per_step=round(ms, 3),
                       floor_ms=float(f"{floor:.4g}"), floor_with_kv_ms=float(f"{floor_kv:.4g}"),
                       x_floor=round(ms / floor, 1), tokens_per_s=round(B / ms * 1e3, 1), weight_bytes=weight_bytes,
                       gb_per_s=a.gb_per_s, dtype=str(dtype).replace("torch.", ""), peak_gib=peak_gib())
            if "graphs" in runs:
                diff = max(float((e - g).abs().max()) for e, g in zip(runs["eager"], runs["graphs"]))
                same = all(torch.equal(e.argmax(-1), g.argmax(-1)) for e, g in zip(runs["eager"], runs["graphs"]))
                print(f"CHECK decode {name} {B} rows graphs vs eager: greedy tokens equal {same}, max |logit "
                      f"difference| {diff:.3g} over 8 steps", flush=True)
                result(stage="decode_graphs_vs_eager", shape=name, rows=B, tokens_equal=same, max_logit_diff=diff)
        del model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------ learn
# The built-in demo (configs/demo_cpu.yaml: the shipped 0.47 M-parameter base model, two-number addition) on one rank
# with bf16 mixed precision: the demo's 32 prompts x 8 completions per step (its 2 ranks' work on one), its cosine
# schedule over 150 steps. On this 2-core CPU (shared) the stage took 132 s, median step 0.82 s (41 % -> 92.5 %). The
# H200 time, ~30-60 s with init and both evaluations, is an estimate, not measured: a step here is a prefill and 4
# decode steps of a 0.47 M-parameter model and two micro-batches, launch-bound, against the 4-layer 0.5B-shape step
# of 64 rows x 256 tokens at 1.2-1.5 s on the H200 (../shared/notes/gpu-h200-figures.md).
LEARN = dict(steps=150, prompts_per_rank=32, eval_limit=None)
if SMOKE:  # a few steps on 8 held-out problems: the code path, not the learning
    LEARN = dict(steps=3, prompts_per_rank=4, eval_limit=8)


def cmd_learn(a) -> None:
    """Held-out greedy accuracy of the demo's base model, LEARN's steps of the demo recipe on this device (1 rank,
    bf16 mixed precision), then the accuracy again. Fails (exit 1) when it did not gain (the full run; a smoke run's
    few steps only have to run)."""
    from grpo_dist import distributed as gdist
    from grpo_dist.config import load_config
    ctx = gdist.init_distributed(600)
    root = Path(__file__).resolve().parents[1]
    L = LEARN
    cfg = load_config(str(root / "configs" / "demo_cpu.yaml"), [
        f"output_dir={Path(a.out) / 'learn'}", f"model.name_or_path={root / 'grpo_dist' / 'tools' / 'demo_base'}",
        f"max_steps={L['steps']}", f"eval_steps={L['steps']}", "save_final=false", "save_best=null",
        "report_to=[jsonl]", "progress_bar=false", f"logging_steps={L['steps']}",
        f"prompts_per_rank={L['prompts_per_rank']}",
        f"data.eval_limit={'null' if L['eval_limit'] is None else L['eval_limit']}",
        "distributed.mixed_precision=bf16"])
    tr = new_trainer(cfg, ctx)
    sync()
    t0 = time.perf_counter()
    before = tr.evaluate()
    steps = []
    while tr.step < L["steps"]:
        steps.append(tr.train_step()["step_time_s"])
    after = tr.evaluate()
    sync()
    wall = time.perf_counter() - t0
    acc0, acc1, n = before["eval_accuracy"], after["eval_accuracy"], int(after["eval_num_examples"])
    gained = acc1 > acc0
    ok = gained or SMOKE
    print(f"CHECK learn demo on {ctx.device}, 1 rank, bf16 mixed precision, {L['steps']} steps of "
          f"{L['prompts_per_rank']} prompts x {cfg.num_generations}: held-out greedy accuracy {acc0:.1%} -> "
          f"{acc1:.1%} on {n} problems ({'gained' if gained else 'NO gain'}); median step "
          f"{statistics.median(steps):.3f} s, {wall:.1f} s with both evaluations", flush=True)
    result(stage="learn", device=str(ctx.device), steps=L["steps"], prompts_per_rank=L["prompts_per_rank"],
           accuracy_before=acc0, accuracy_after=acc1, problems=n, gained=gained, ok=ok,
           median_step_s=round(statistics.median(steps), 4), seconds=round(wall, 1), peak_gib=peak_gib())
    close(tr)
    gdist.cleanup()
    if not ok:
        raise SystemExit(f"held-out accuracy did not gain: {acc0:.3f} -> {acc1:.3f}")


# ------------------------------------------------------------------------------------------------------ long
# Issue 29's long-completion step at the 0.5B shape: bench/long_cot.py's lognormal lengths (median 200, p95 900,
# cap 1024) over the 0.5B config's per-rank rows (8 prompts x 8), every lever on.
LONG = dict(prompts_per_rank=8, num_generations=8, median=200, p95=900, cap=1024, budget=8192)
if SMOKE:
    LONG = dict(prompts_per_rank=2, num_generations=8, median=12, p95=48, cap=64, budget=512)
LONG_PASSES = ("decode", "reference", "old", "train")


def cmd_long(a) -> None:
    """One GRPO step of the real trainer with long-tailed completions, every lever on (padding_free,
    max_tokens_per_micro_batch, decode_compaction_threshold at its default): each row's length is forced by EOS
    placement (long_cot.ForcedLengths around the lean decoder), num_iterations=2 so the old-policy pass runs too.
    Reports per phase time, tokens computed vs needed per pass (tokens/processed_* and tokens/useful_*, decode
    included) and the peak memory (max_memory_allocated on CUDA, peak RSS on a CPU)."""
    from bench_common import peak_rss_mib
    from long_cot import ForcedLengths, lengths

    from grpo_dist import distributed as gdist
    from grpo_dist import rollout_engines
    ctx = gdist.init_distributed(600)
    L = dict(LONG, budget=a.budget or LONG["budget"])
    rows = L["prompts_per_rank"] * L["num_generations"]
    targets = lengths(rows, L["median"], L["p95"], L["cap"])
    cfg = make_config(a.model, Path(a.out) / "long", max_steps=1, num_iterations=2, rollout_engine="lean",
                      prompts_per_rank=L["prompts_per_rank"], num_generations=L["num_generations"],
                      max_completion_length=L["cap"], micro_batch_size=64, padding_free=True,
                      max_tokens_per_micro_batch=L["budget"])
    assert cfg.padding_free and cfg.max_tokens_per_micro_batch == L["budget"]
    tr = new_trainer(cfg, ctx)
    eos = list(tr.sampling_spec().eos_ids)
    make = rollout_engines.make_decoder
    rollout_engines.make_decoder = lambda *args, **kw: ForcedLengths(make(*args, **kw), targets, eos)
    sync()
    reset_peak()
    t0 = time.perf_counter()
    m = tr.train_step()
    sync()
    wall = time.perf_counter() - t0
    mean = sum(targets) / len(targets)
    forced = abs(m["completion_length_mean"] - mean) < 1e-6 and m["completion_length_max"] == max(targets)
    tokens = {}
    for p in LONG_PASSES:
        done = float(m.get(f"tokens/processed_{p}", 0.0))  # useful less the prompt copies share_prompts saved
        need = float(m.get(f"tokens/useful_{p}", 0.0)) - float(m.get(f"tokens/shared_{p}", 0.0))
        tokens[p] = dict(processed=done, useful=need, padding_fraction=round(1 - need / done, 4) if done else 0.0)
    pad = {p: t["padding_fraction"] for p, t in tokens.items()}
    times = dict(rollout_s=round(m["time_rollout_s"], 3), logprobs_s=round(m.get("time_logprobs_s", 0.0), 3),
                 update_s=round(m["time_update_s"], 3))
    peak, rss = peak_gib(), round(peak_rss_mib(), 1)
    # issue 29's bars: padding at most 5 % of the tokens computed in every log-prob and training pass, 15 % in decode
    bars = pad["decode"] <= 0.15 and all(pad[p] <= 0.05 for p in LONG_PASSES[1:])
    print(f"CHECK long {Path(a.model).name} {rows} rows, cap {L['cap']} (lengths median {L['median']:g}, p95 "
          f"{L['p95']:g}; mean {mean:.1f}, max {max(targets)}), budget {L['budget']} tokens: lengths forced: "
          f"{forced}; rollout {times['rollout_s']:.2f} s, log-probs {times['logprobs_s']:.2f} s, update "
          f"{times['update_s']:.2f} s; computed/useful "
          + ", ".join(f"{p} {t['processed']:.0f}/{t['useful']:.0f} ({100 * t['padding_fraction']:.1f} % pad)"
                      for p, t in tokens.items())
          + f"; peak {f'{peak} GiB' if peak is not None else 'n/a'}, RSS {rss:.0f} MiB; issue 29's padding bars "
          f"(decode <= 15 %, passes <= 5 %) {'met' if bars else 'NOT met'}", flush=True)
    tokens_per_s = m["completion_length_mean"] * rows / max(m["time_rollout_s"], 1e-9)
    print(f"CHECK long rollout: {tokens_per_s:.0f} completion tokens/s (engine {cfg.rollout_engine}, "
          f"lean_cuda_graphs {cfg.lean_cuda_graphs}: the run's defaults)", flush=True)
    # the step's model FLOPs over each pass's time and the device's bf16 peak (grpo_dist/flops.py; null on a CPU)
    passes = {k: m.get(k) for k in ("mfu", "mfu_update", "mfu_logprobs", "tokens_per_s_update",
                                    "tokens_per_s_logprobs")}
    pct = {k: "n/a" if v is None else f"{100 * v:.1f} %" for k, v in passes.items() if k.startswith("mfu")}
    print(f"CHECK long {Path(a.model).name} per pass: update {passes['tokens_per_s_update'] or 0:.0f} tokens/s, "
          f"MFU {pct['mfu_update']}; log-probs {passes['tokens_per_s_logprobs'] or 0:.0f} tokens/s, MFU "
          f"{pct['mfu_logprobs']}; step MFU {pct['mfu']} (issue 37's bar: update >= 15 %)", flush=True)
    result(stage="long", model=Path(a.model).name, rows=rows, rollout_tokens_per_s=round(tokens_per_s, 1),
           **{k: None if v is None else round(v, 4 if k.startswith("mfu") else 1) for k, v in passes.items()},
           cap=L["cap"], median=L["median"], p95=L["p95"],
           budget=L["budget"], lengths_forced=forced, completion_length_mean=m["completion_length_mean"],
           completion_length_max=m["completion_length_max"], **times, step_s=round(sum(times.values()), 3),
           wall_s=round(wall, 3), tokens=tokens, padding_fraction=pad, padding_bars_met=bars, loss=m["loss"],
           peak_gib=peak, peak_rss_mib=rss, device=str(ctx.device), padding_free=cfg.padding_free,
           decode_compaction_threshold=cfg.decode_compaction_threshold)
    close(tr)
    gdist.cleanup()
    if not forced:
        raise SystemExit(f"completion lengths (mean {m['completion_length_mean']}, max "
                         f"{m['completion_length_max']}) are not the forced ones (mean {mean}, max {max(targets)})")


# ------------------------------------------------------------------------------------------------------ async
# Issue 23's asynchronous mode on the one GPU: bench/async.py's configurations and figures (its functions, by
# import), the 0.5B config's per-rank rows (8 prompts x 8) on long_cot.py's lengths scaled to a 256-token cap.
ASYNC = dict(prompts=8, num_generations=8, cap=256, steps=3, staleness=(0, 1))  # 4 steps took ~200 s on an H200
if SMOKE:
    ASYNC = dict(prompts=2, num_generations=4, cap=16, steps=3, staleness=(0, 1))


def bench_async():
    """bench/async.py as a module (its name is a Python keyword, so no plain import)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_async", Path(__file__).with_name("async.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weight_bytes_bf16(model_dir: str) -> int:
    """What one weight broadcast sends: every distinct parameter (a tied head once) in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return 2 * sum(p.numel() for p in model.parameters())


def cmd_async(a) -> None:
    """1 trainer + 1 rollout rank (rollout_ranks=1) on one GPU at max_staleness 0 and 1, against a 1-process colocated
    reference with the same prompts per step (one process has the whole GPU, as the two async ranks share it; two
    colocated processes would split the GPU and add FSDP gathers over gloo). bf16 compute. Each configuration is
    bench/async.py's torchrun job, so the figures are its own: completion tokens trained per second (all steps and
    once the pipeline is full, steps >= k + 1), each side's idle fraction, weight-broadcast time and bytes, lag.
    The reference runs first and every configuration reports as it ends (a stage cut by its time limit keeps what
    ran). Fails (exit 1) when the lag of a step is not min(step, k), a batch was dropped, or a version's bytes are
    not the model's parameters in bf16; the throughput figures are reported, not judged."""
    from grpo_dist.distributed import cuda_device
    bench = bench_async()
    A = ASYNC
    args, ks = bench.configure(
        ["--model", a.model, "--steps", str(A["steps"]), "--staleness", ",".join(map(str, A["staleness"])),
         "--prompts", str(A["prompts"]), "--num-generations", str(A["num_generations"]), "--length-cap",
         str(A["cap"]), "--max-prompt-length", "256", "--colocated-ranks", "1", "--mixed-precision", "bf16"])
    # the two async ranks' groups: gloo on a one-GPU machine (NCCL refuses two ranks on one GPU), gloo on a CPU
    group = cuda_device(1, 2, torch.cuda.device_count(), True)[1] if CUDA else "gloo"
    colo = bench.run_config(args, -1)
    print(bench.describe("colocated", colo), flush=True)
    print(f"CHECK async colocated (1 process, the same {A['prompts']} prompts x {A['num_generations']} per step): "
          f"{colo['tokens_per_s']:.1f} completion tokens/s, {colo['tokens_per_s_full']:.1f} after step 0; rollout "
          f"{colo['rollout_s_per_token'] * 1e3:.3f} ms/token, train {colo['train_s_per_token'] * 1e3:.3f} ms/token",
          flush=True)
    result(stage="async", config="colocated", **_async_row(colo))
    expected = weight_bytes_bf16(a.model)
    problems = []
    for k in ks:
        r = bench.run_config(args, k)
        print(bench.describe(f"async_k{k}", r), flush=True)
        lags = [min(s, k) for s in range(A["steps"])]
        if r["lag_per_step"] != lags or r["dropped"]:
            problems.append(f"k={k}: lag per step {r['lag_per_step']} (expected {lags}), dropped {r['dropped']:g}")
        if r["weight_sync_bytes_per_version"] != expected:
            problems.append(f"k={k}: {r['weight_sync_bytes_per_version']:.0f} bytes per version, expected "
                            f"{expected} (the parameters in bf16)")
        print(f"CHECK async k={k} ({A['prompts']} prompts x {A['num_generations']} per step, cap {A['cap']}, "
              f"{A['steps']} steps, groups {group}): {r['tokens_per_s']:.1f} completion tokens/s, full pipeline "
              f"{r['tokens_per_s_full']:.1f} (colocated {colo['tokens_per_s_full']:.1f}, x"
              f"{r['tokens_per_s_full'] / colo['tokens_per_s_full']:.2f}); idle trainer "
              f"{r['trainer_idle_fraction']:.1%} / rollout {r['rollout_idle_fraction']:.1%} (full: "
              f"{r['trainer_idle_fraction_full']:.1%} / {r['rollout_idle_fraction_full']:.1%}); weight sync "
              f"{r['weight_sync_s_per_step'] * 1e3:.1f} ms/step, {r['weight_sync_bytes_per_version'] / 2**20:.2f} "
              f"MiB/version; lag mean {r['lag_mean']:.2f} max {r['lag_max']:g}", flush=True)
        result(stage="async", config=f"async_k{k}", groups=group, **_async_row(r))
    print(f"CHECK async verdict: {'ok' if not problems else 'FAILED'}: lag of step s = min(s, k), nothing dropped, "
          f"{expected} bytes per version (the parameters in bf16)" + "".join(f"; {x}" for x in problems), flush=True)
    result(stage="async_verdict", ok=not problems, problems=problems, bytes_expected=expected, groups=group)
    if problems:
        raise SystemExit(1)


def _async_row(r: dict) -> dict:
    """bench/async.py's figures of one configuration, without its per-step lists."""
    return {k: v for k, v in r.items() if not isinstance(v, list)} | {"lag_per_step": r.get("lag_per_step")}


# ------------------------------------------------------------------------------------------------------ summary
PICK = {"start": ("cmd", "torch", "gpu"),
        "build": ("kind", "params_m", "tied", "seconds"),
        "init": ("run", "engine", "save_format", "seconds", "peak_gib"),
        "step": ("run", "step", "step_time_s", "rollout_s", "logprobs_s", "update_s", "rollout_tokens_per_s",
                 "train_tokens_per_s", "mfu", "mfu_update", "mfu_logprobs", "peak_gib"),
        "save": ("run", "time_save_blocking_s", "time_save_s"),
        "phase": ("run", "phase", "calls", "median_s", "peak_gib"),
        "resume": ("format", "ok", "last_loss_equal", "max_weight_diff", "error"),
        "evaluate": ("ok", "seconds", "problems", "accuracy", "peak_gib"),
        "meta": ("device", "misplaced", "examples", "loss", "step_time_s", "peak_gib"),
        "decode": ("shape", "rows", "mode", "ms_per_step", "floor_ms", "floor_with_kv_ms", "x_floor", "tokens_per_s",
                   "peak_gib"),
        "decode_graphs_vs_eager": ("shape", "rows", "tokens_equal", "max_logit_diff"),
        "learn": ("device", "steps", "accuracy_before", "accuracy_after", "problems", "gained", "median_step_s",
                  "seconds", "peak_gib"),
        "long": ("model", "rows", "cap", "lengths_forced", "rollout_s", "rollout_tokens_per_s", "logprobs_s",
                 "update_s", "tokens_per_s_logprobs", "tokens_per_s_update", "mfu_logprobs", "mfu_update", "mfu",
                 "padding_fraction", "peak_gib", "peak_rss_mib"),
        "async": ("config", "groups", "tokens_per_s", "tokens_per_s_full", "trainer_idle_fraction",
                  "trainer_idle_fraction_full", "rollout_idle_fraction", "rollout_idle_fraction_full",
                  "weight_sync_s_per_step", "weight_sync_bytes_per_version", "lag_mean", "lag_max", "lag_per_step"),
        "async_verdict": ("ok", "problems", "bytes_expected", "groups")}
ARCHIVE = "gpu_check.tgz"  # what gpu_check.sh leaves in $OUT, with summary.txt


def read_results(path: str) -> str:
    """results.jsonl's text from the file, or from the gpu_check.tgz that holds it: $OUT keeps the archive and the
    summary only, so `summary $OUT/results.jsonl` (gpu-first-run.md's command) reads it from the archive."""
    import tarfile
    p = Path(path)
    if p.is_file() and not p.name.endswith(".tgz"):
        return p.read_text()
    tgz = p if p.name.endswith(".tgz") else (p if p.is_dir() else p.parent) / ARCHIVE
    if not tgz.is_file():
        raise SystemExit(f"no {p} and no {tgz}")
    with tarfile.open(tgz) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("results.jsonl")), None)
        if member is None:
            raise SystemExit(f"{tgz} holds no results.jsonl")
        f = tar.extractfile(member)
        return f.read().decode() if f else ""


def cmd_summary(a) -> None:
    for line in read_results(a.results).splitlines():
        r = json.loads(line)
        keys = PICK.get(r.get("stage"), ())
        print(f"{r.get('stage', '?'):9s}", "  ".join(f"{k}={r[k]}" for k in keys if r.get(k) is not None))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--root", required=True)
    b.add_argument("--kinds", default="qwen05,qwen05_4l,qwen05_4l_untied")
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--format", choices=["full", "sharded"], default="sharded")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--save-at", type=int, default=2)
    t.add_argument("--eval-steps", type=int, default=0)
    e = sub.add_parser("evaluate")
    e.add_argument("--model", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--limit", type=int, default=16)
    m = sub.add_parser("meta")
    m.add_argument("--model", required=True)
    m.add_argument("--out", required=True)
    d = sub.add_parser("decode")
    # H200 HBM3e: 4.8 TB/s (H100 SXM 3.35, A100 80GB 2.0); on a CPU the floor is a nominal figure
    d.add_argument("--gb-per-s", type=float, default=float(os.environ.get("GPU_CHECK_HBM_GBPS", 4800)))
    ln = sub.add_parser("learn")
    ln.add_argument("--out", required=True)
    lg = sub.add_parser("long")
    lg.add_argument("--model", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--budget", type=int, default=0, help="max_tokens_per_micro_batch (0: 8192, smoke 512)")
    asy = sub.add_parser("async")
    asy.add_argument("--model", required=True)
    s = sub.add_parser("summary")
    s.add_argument("results")
    a = ap.parse_args(argv)
    if a.cmd != "summary":
        result(stage="start", cmd=a.cmd, smoke=SMOKE, torch=torch.__version__,
               gpu=torch.cuda.get_device_name() if CUDA else None)
    {"build": cmd_build, "train": cmd_train, "evaluate": cmd_evaluate, "meta": cmd_meta, "decode": cmd_decode,
     "learn": cmd_learn, "long": cmd_long, "async": cmd_async, "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

"""Kernels and host syncs of one lean decode step (issue 36): a random Llama/Qwen2-shaped model, the rollout's
sampling loop (grpo_dist.rollout._sample_loop on decoder.LeanDecoder, sampled with per-row noise, top-k and top-p)
under torch.profiler.

    python bench/decode_ops.py --layers 24 --hidden 64 --rows 64          # the CPU bars: <= 20 kernels per layer,
                                                                           # <= 0.125 host syncs per decode step
    python bench/decode_ops.py --device cuda --layers 24 --hidden 896 --heads 14 --kv-heads 2 --vocab 151936

How it counts (the last line is one JSON object):
- a "kernel" is an outermost aten op (one that no other aten op called) that computes something: its own name or an
  op under it is not a view or metadata op (view, reshape without a copy, slice, transpose, expand, empty, a no-op
  `to`, ...; VIEW_OPS). On a CPU this counts what the Python code asks the device to do, one launch per op on a GPU
  for every op the step uses (rms_norm is one fused kernel on CUDA); on CUDA the kernels the profiler saw run on the
  device are reported too (cuda_kernels_per_step).
- kernels_per_step and host_syncs_per_step: the sampling loop run for 2S and for S decode steps (same prompts, rows
  that never end), the difference over S: the prefill and everything once per rollout cancel out.
- kernels_per_layer: one decoder step with all its layers minus the same step with none, over the layers.
- a host sync is an outermost aten op whose subtree reads a value the host must wait for (_local_scalar_dense:
  item/int/float/bool; nonzero, masked_select, unique: outputs whose size depends on the data), plus every Python
  call of Tensor.tolist, .numpy, .cpu or .to a CPU device (a TorchFunctionMode sees them; on a CPU tolist reaches no
  aten op). On a CPU nothing waits, but the same code on a GPU would; on CUDA cudaStreamSynchronize /
  cudaDeviceSynchronize events are reported too (cuda_syncs_per_step).
- ms_per_step: wall time of (loop of 2S steps - loop of S) / S, median of --reps, no profiler; on CUDA also with
  CUDA graphs (ms_per_step_graphs) and, with --compile, torch.compile (ms_per_step_compile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VIEW_OPS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unflatten", "flatten", "transpose", "t", "permute",
            "expand", "expand_as", "slice", "select", "narrow", "as_strided", "squeeze", "unsqueeze", "chunk", "split",
            "split_with_sizes", "unbind", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided",
            "resize_", "view_as", "contiguous", "result_type", "to", "type_as", "_has_compatible_shallow_copy_type",
            "numel", "size", "stride", "is_nonzero_", "broadcast_tensors", "diagonal", "movedim", "view_as_real",
            "view_as_complex", "_reshape_copy_", "real", "imag", "conj", "resolve_conj", "resolve_neg",
            "set_", "_nested_tensor_from_mask_left_aligned", "record_stream", "_to_copy_noop"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
            "_unique", "nonzero_numpy"}
HOST_READS = {"tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor values into host memory that reach no aten op on a CPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.count += 1
        elif name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if target is not None and not isinstance(target, torch.dtype) and torch.device(target).type == "cpu":
                self.count += 1
        return func(*args, **kwargs)


def _short(name: str) -> str:
    return name[len("aten::"):].split(".")[0] if name.startswith("aten::") else name


def count_events(events) -> dict:
    """Outermost aten ops that compute (kernels) and that sync (module docstring); CUDA kernels and syncs."""
    children: dict[int, list] = {}
    for e in events:
        if e.cpu_parent is not None:
            children.setdefault(id(e.cpu_parent), []).append(e)

    def subtree(e):
        yield e
        for c in children.get(id(e), ()):
            yield from subtree(c)

    def outermost(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return False
            p = p.cpu_parent
        return True

    kernels = syncs = cuda_kernels = cuda_syncs = 0
    for e in events:
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            cuda_syncs += 1
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            cuda_kernels += 1
        if not e.name.startswith("aten::") or not outermost(e):
            continue
        names = [_short(x.name) for x in subtree(e) if x.name.startswith("aten::")]
        kernels += any(n not in VIEW_OPS for n in names)
        syncs += any(n in SYNC_OPS for n in names)
    return dict(kernels=kernels, syncs=syncs, cuda_kernels=cuda_kernels, cuda_syncs=cuda_syncs)


def profiled(fn) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    reads = HostReads()
    with torch.profiler.profile(activities=activities) as prof, reads:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = count_events(prof.events())
    out["syncs"] += reads.count
    return out


def build_model(a):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_dist.decoder import prepare_replica
    head_dim = a.head_dim or min(64, a.hidden // 4)
    heads = a.heads or a.hidden // head_dim
    cfg = Qwen2Config(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads,
                      num_key_value_heads=a.kv_heads or max(1, heads // 2), head_dim=head_dim,
                      intermediate_size=a.intermediate or 4 * a.hidden, vocab_size=a.vocab,
                      tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=a.prompt + 2 * a.steps + 64)
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype)).eval().requires_grad_(False)
    prepare_replica(model)
    return model


def loop_runner(model, a, graphs: bool = False, compile_step: bool = False):
    """A function of S: the sampling loop for S decode steps (rows never end: EOS is an id the model cannot emit)."""
    from grpo_dist.decoder import LeanDecoder
    from grpo_dist.rollout import _sample_loop
    from grpo_dist.sampling_noise import row_noise
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.rows, a.prompt), generator=g).to(a.device)
    mask = torch.ones_like(ids)
    eos = torch.tensor([a.vocab], device=a.device)  # never sampled: every row decodes every step
    noise = row_noise(list(range(a.rows)), 2 * a.steps + 1, a.device)
    kw = dict(cuda_graphs=graphs, compile_step=compile_step) if compile_step else dict(cuda_graphs=graphs)
    decoder = LeanDecoder(model, **kw)

    def run(steps: int):
        return _sample_loop(decoder, ids, mask, None, max_new_tokens=steps + 1, temperature=0.8, top_p=0.95,
                            top_k=50, min_new_tokens=0, do_sample=True, eos_ids=eos, pad=0, logprobs_out=[],
                            noise=noise[:, :steps + 1], compaction_threshold=0.125)
    return run


def wall(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def ms_per_step(run, steps: int, reps: int) -> float:
    run(steps)  # warm-up (and graph capture)
    diffs = [(wall(lambda: run(2 * steps)) - wall(lambda: run(steps))) / steps * 1e3 for _ in range(reps)]
    return statistics.median(diffs)


@torch.inference_mode()
def per_layer(model, a) -> float:
    """Kernels of one decoder step with every layer minus the same step with none, over the layers."""
    from grpo_dist.decoder import LeanDecoder
    dec = LeanDecoder(model)
    ids = torch.randint(0, a.vocab, (a.rows, a.prompt), device=a.device)
    dec.prefill(ids, torch.ones_like(ids), None, 8)
    tokens = ids[:, -1]
    dec.step(tokens)  # attention width settled
    full = profiled(lambda: dec.step(tokens))["kernels"]
    dec.layers = []  # static_step zips layers with caches: no layer runs
    none = profiled(lambda: dec.step(tokens))["kernels"]
    return (full - none) / a.layers


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=0, help="0: hidden / head_dim")
    ap.add_argument("--kv-heads", type=int, default=0, help="0: heads / 2")
    ap.add_argument("--head-dim", type=int, default=0, help="0: min(64, hidden / 4)")
    ap.add_argument("--intermediate", type=int, default=0, help="0: 4 x hidden")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16, help="S: the loops run S and 2S decode steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--compile", action="store_true", help="also time lean_compile (torch.compile of the step)")
    ap.add_argument("--no-timing", action="store_true", help="counts only")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model = build_model(a)
    run = loop_runner(model, a)
    run(a.steps)  # warm-up outside the profiler
    short, long = profiled(lambda: run(a.steps)), profiled(lambda: run(2 * a.steps))
    S = a.steps
    out = dict(layers=a.layers, hidden=a.hidden, vocab=a.vocab, rows=a.rows, steps=S, device=a.device, dtype=a.dtype,
               kernels_per_step=(long["kernels"] - short["kernels"]) / S, kernels_per_layer=per_layer(model, a),
               host_syncs_per_step=(long["syncs"] - short["syncs"]) / S)
    if a.device.startswith("cuda"):
        out["cuda_kernels_per_step"] = (long["cuda_kernels"] - short["cuda_kernels"]) / S
        out["cuda_syncs_per_step"] = (long["cuda_syncs"] - short["cuda_syncs"]) / S
    if not a.no_timing:
        out["ms_per_step"] = round(ms_per_step(run, S, a.reps), 4)
        if a.device.startswith("cuda"):
            out["ms_per_step_graphs"] = round(ms_per_step(loop_runner(model, a, graphs=True), S, a.reps), 4)
        if a.compile:
            out["ms_per_step_compile"] = round(ms_per_step(loop_runner(model, a, compile_step=True), S, a.reps), 4)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

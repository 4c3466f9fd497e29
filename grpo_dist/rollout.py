"""Rollouts: G sampled completions per prompt, batched, from a plain per-rank copy of the policy.

Generation runs on an unsharded replica refreshed from the FSDP shards once per step: it needs no collectives, so
ranks that finish early (all EOS) or late (max_completion_length) never wait on each other, and it was measured
2-3x faster than generating through summon_full_params.

Layout of a batch (N = prompts x G rows):
    [ left-padded prompt (P columns) | completion, right-padded (C columns) ]
completion_mask is 1 for every generated token up to and including the first EOS, 0 for padding after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grpo_dist.compaction import keep_rows, should_compact
from grpo_dist.data.prompts import RenderedPrompt, encode_prompts
from grpo_dist.decoder import LeanDecoder, lean_decoder_unsupported
from grpo_dist.sampling_noise import row_noise


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor        # [N, P] long, left-padded
    prompt_mask: torch.Tensor       # [N, P]
    completion_ids: torch.Tensor    # [N, C] long, right-padded
    completion_mask: torch.Tensor   # [N, C], EOS included
    num_generations: int
    completions: list[str] = field(default_factory=list)  # decoded completion texts
    references: list[str] = field(default_factory=list)   # reference answer per row
    # [N, C] fp32: the rollout engine's own log-prob of each completion token (rollout_engines.py says which), for
    # the sampler/trainer mismatch metrics and the importance-sampling correction; None: not recorded
    sampler_logprobs: torch.Tensor | None = None
    # rows the decoder computed, summed over its steps (tokens/processed_decode); None: not counted (vLLM)
    decode_row_steps: int | None = None
    # prompts of this batch (each once, not per completion) longer than max_prompt_length tokens: their beginning
    # was cut (the prompts_truncated metric)
    prompts_truncated: int = 0
    # [N, C] long, multi-turn episodes (grpo_dist.environments): 1 on the model's tokens, 0 on the environment's
    # observations (context, never trained on: TRL's name); None: every completion token is the model's
    tool_mask: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the loss, its token normaliser, entropy, KL and the sampler/trainer check count: the model's
        own (completion_mask, less observations). Without observations: completion_mask itself."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def to(self, device) -> RolloutBatch:
        return RolloutBatch(self.prompt_ids.to(device), self.prompt_mask.to(device), self.completion_ids.to(device),
                            self.completion_mask.to(device), self.num_generations, self.completions,
                            self.references,
                            None if self.sampler_logprobs is None else self.sampler_logprobs.to(device),
                            prompts_truncated=self.prompts_truncated,
                            tool_mask=None if self.tool_mask is None else self.tool_mask.to(device))

    def rows(self, index: list[int]) -> RolloutBatch:
        """A sub-batch, trimmed to the columns its rows use (less padding in every forward pass)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        pm, cm = self.prompt_mask[idx], self.completion_mask[idx]
        p_used = pm.any(0).nonzero()
        p_start = int(p_used[0]) if len(p_used) else pm.shape[1] - 1
        c_end = max(1, int(cm.sum(-1).max())) if len(idx) else 1
        return RolloutBatch(self.prompt_ids[idx, p_start:], pm[:, p_start:], self.completion_ids[idx, :c_end],
                            cm[:, :c_end], self.num_generations,
                            [self.completions[i] for i in index] if self.completions else [],
                            [self.references[i] for i in index] if self.references else [],
                            None if self.sampler_logprobs is None else self.sampler_logprobs[idx, :c_end],
                            tool_mask=None if self.tool_mask is None else self.tool_mask[idx, :c_end])


def concat_rollouts(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of the rows of several (dynamic sampling's rounds): prompts left-padded, completions
    right-padded to the widest."""
    P = max(b.prompt_ids.shape[1] for b in batches)
    C = max(b.completion_ids.shape[1] for b in batches)

    def pad(t, width, left, value):
        extra = width - t.shape[1]
        fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
        return torch.cat([fill, t] if left else [t, fill], dim=1)

    return RolloutBatch(torch.cat([pad(b.prompt_ids, P, True, pad_id) for b in batches]),
                        torch.cat([pad(b.prompt_mask, P, True, 0) for b in batches]),
                        torch.cat([pad(b.completion_ids, C, False, pad_id) for b in batches]),
                        torch.cat([pad(b.completion_mask, C, False, 0) for b in batches]),
                        batches[0].num_generations, [c for b in batches for c in b.completions],
                        [r for b in batches for r in b.references],
                        None if any(b.sampler_logprobs is None for b in batches) else
                        torch.cat([pad(b.sampler_logprobs, C, False, 0.0) for b in batches]),
                        tool_mask=None if all(b.tool_mask is None for b in batches) else
                        torch.cat([pad(b.completion_mask if b.tool_mask is None else b.tool_mask, C, False, 0)
                                   for b in batches]))


def cut_off(batch: RolloutBatch, eos_ids) -> torch.Tensor:
    """[N] bool: rows whose completion has no EOS token of the model's own (an observation's EOS tokens, e.g.
    Qwen's <|im_end|> closing a tool response, do not count), i.e. was cut at max_completion_length (or an
    episode at max_turns / its token cap)."""
    ids = torch.as_tensor(list(eos_ids), device=batch.completion_ids.device)
    return ~(torch.isin(batch.completion_ids, ids) & batch.loss_mask.bool()).any(-1)


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (rows without EOS are all 1)."""
    eos_ids = torch.as_tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id],
                              device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos_ids)
    n = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], n, dtype=torch.long))
    return (torch.arange(n, device=completion_ids.device)[None, :] <= first[:, None]).long()


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation_config.eos_token_id (an int
    or a list; Qwen2.5 Instruct stops at both <|im_end|> and <|endoftext|>, as `generate` does)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += list(configured) if isinstance(configured, (list, tuple)) else [configured]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def tokenize_prompts(tokenizer, prompts: Sequence[str | RenderedPrompt], max_prompt_length: int,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask; over-long prompts keep their last max_prompt_length tokens (the question sits at
    the end of a template). Rendered prompts (data.render_prompt) keep their row text as text, strings are
    tokenized as they are (data.encode_prompts)."""
    rows = [ids[max(0, len(ids) - max_prompt_length):] for ids in encode_prompts(tokenizer, prompts)]
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _filter_scores(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then nucleus (top-p) filtering of [B, V] fp32 scores: dropped tokens get -inf. The most likely token
    always survives."""
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1.0 - top_p  # the low tail holding at most 1 - top_p of the mass
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def sample_from_scores(scores: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from softmax(scores) by inverse CDF: a single uniform number per row. torch.multinomial
    draws an exponential variate for every vocabulary entry, 15x slower at vocab 1k (bench/generation.py).
    Tokens with probability 0 (filtered to -inf) are never drawn: the CDF does not rise there. uniforms: [rows]
    in [0, 1), this step's column of the rows' own noise (grpo_dist.sampling_noise); None: the process RNG."""
    cdf = scores.softmax(-1).cumsum_(-1)
    if uniforms is None:
        uniforms = torch.rand(cdf.shape[0], device=cdf.device, dtype=cdf.dtype)
    u = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _cache_kwarg(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name still works, with a warning)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFDecoder:
    """The transformers forward with its own cache, behind LeanDecoder's prefill/step interface (the fallback for
    models the lean decoder does not cover)."""

    def __init__(self, model):
        self.model = model
        self.cache_kw = _cache_kwarg(model)

    def prefill(self, ids, mask, repeats, max_new_tokens):
        if repeats is not None:  # no shared prefix here: every row is prefilled
            ids, mask = ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
        B, P = ids.shape
        self.full_mask = torch.ones(B, P + max_new_tokens, dtype=mask.dtype, device=ids.device)
        self.full_mask[:, :P] = mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        self.cache = out["cache"] if "cache" in out else out.past_key_values
        self.next_pos, self.length = pos[:, -1:] + 1, P
        return out.logits[:, -1]

    def step(self, tokens):
        self.length += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.full_mask[:, :self.length],
                         position_ids=self.next_pos, use_cache=True, **{self.cache_kw: self.cache})
        self.cache = out["cache"] if "cache" in out else out.past_key_values
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the decode rows `keep` (grpo_dist.compaction): the transformers cache, mask and positions."""
        self.cache.batch_select_indices(keep)
        self.full_mask, self.next_pos = self.full_mask[keep], self.next_pos[keep]


def make_decoder(model, total_length: int, lean: bool = True, cuda_graphs: bool = False, compile_step: bool = False,
                 run: RunDecoder | None = None):
    """LeanDecoder where it covers the model (bench/generation.py: the transformers forward spends most of a decode
    step outside the model's arithmetic), else the transformers forward. cuda_graphs: LeanDecoder replays its
    decode steps from CUDA graphs (config lean_cuda_graphs); compile_step: torch.compile of its step
    (lean_compile). run: the engine's RunDecoder, which keeps one such decoder (its buffers and graphs) for the
    whole run."""
    why = lean_decoder_unsupported(model, total_length) if lean else "lean_decoder off"
    if why is None and run is not None and (cuda_graphs or compile_step):
        return run.decoder(model)
    if why is not None and run is not None and lean and cuda_graphs:
        run.say_once("unsupported", f"[grpo_dist] lean decoder: decoding with the transformers forward, without "
                                    f"CUDA graphs: {why}")
    if why is None:
        return LeanDecoder(model, cuda_graphs, compile_step=compile_step)
    return HFDecoder(model)


class RunDecoder:
    """The one LeanDecoder with CUDA graphs (or a compiled step) an engine keeps for the whole run: its buffers are
    allocated for capacity = (the largest generation batch, prompt + completion tokens) at the first rollout and its
    graphs captured once, then replayed in every rollout and evaluation (decoder.CUDAGraphSteps). A new one is built
    only when the replica's parameters were replaced (LeanDecoder.weights_moved), with a line saying so. say: where
    lines go; the memory line (KV cache and graph pool) is said once, after the first rollout (report_memory)."""

    def __init__(self, capacity: tuple[int, int], cuda_graphs: bool, compile_step: bool, capture: bool, say=None):
        self.capacity, self.cuda_graphs, self.compile_step, self.capture = capacity, cuda_graphs, compile_step, capture
        self.say = say or (lambda line: print(line, flush=True))
        self.said: set[str] = set()
        self.current: LeanDecoder | None = None
        self.memory_said = False

    def say_once(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(line)

    def decoder(self, model) -> LeanDecoder:
        if self.current is not None and self.current.weights_moved(model):
            self.say_once("moved", "[grpo_dist] lean decoder: the replica's parameters were replaced, not filled in "
                                   "place: its CUDA graphs are captured again")
            self.current = None
        if self.current is None:
            self.current = LeanDecoder(model, self.cuda_graphs, self.capture, self.compile_step, self.capacity,
                                       say=self.say)
        return self.current

    def report_memory(self) -> dict | None:
        """After a rollout: the memory line, once (None before the buffers exist)."""
        graphs = None if self.current is None else self.current.graphs
        if graphs is None or graphs.run is None:
            return None
        m = graphs.memory()
        if not self.memory_said:
            self.memory_said = True
            self.say(f"[grpo_dist] lean decoder {'CUDA graphs' if self.capture else 'static step'}: KV cache "
                     f"{m['cache_bytes'] / 2**30:.3f} GiB for {m['rows']} rows x {m['length']} tokens, allocated "
                     f"once; buckets {list(m['buckets'])}; graph pool {m['pool_bytes'] / 2**30:.3f} GiB after "
                     f"{m['graphs']} graphs (the first rollout's; more widths and buckets add to it)")
        return m


# The sampling loop keeps EOS and the finished rows on the device; the host reads them (one sync: "how many rows have
# finished?") after every STOP_CHECK_EVERY-th step, where it stops when all have and compacts the decode batch
# (grpo_dist.compaction). A step whose every row had finished costs at most STOP_CHECK_EVERY - 1 extra steps of the
# smallest decode batch at the end of a rollout, and compaction comes up to that many steps late: docs/decoding.md
# counts it (long-tailed lengths, cap 1024: +0.6 % rows computed; cap 128: +4 %). Tokens and log-probs do not depend
# on it: a finished row only emits padding.
STOP_CHECK_EVERY = 8


def _token_logprobs(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(scores)[token] per row, fp32."""
    return scores.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scores, -1)


@torch.inference_mode()
def _sample_loop(decoder, ids, mask, repeats, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 min_new_tokens: int, do_sample: bool, eos_ids: torch.Tensor, pad: int,
                 logprobs_out: list | None = None, noise: torch.Tensor | None = None,
                 compaction_threshold: float | None = None, stats: dict | None = None,
                 full_logprobs: bool = False) -> torch.Tensor:
    """KV-cached sampling without `generate`'s per-token machinery. Same semantics as generate: scores in fp32;
    EOS banned for the first min_new_tokens; then temperature, top-k, top-p; a row that emitted EOS gets padding
    afterwards; stops when every row is done. ids/mask are the unique prompts, repeats[i] the rows that continue
    prompt i (None: one each). Returns [rows, <= max_new_tokens]. Greedy decoding gives generate's tokens; sampling
    draws from the same distribution with another use of the RNG (sample_from_scores). logprobs_out, when given,
    receives per step the fp32 log-prob of each row's token under the distribution it was drawn from (temperature,
    then top-k / top-p renormalised, like vLLM's processed_logprobs; greedy: the plain softmax), 0 for rows that
    left the decode batch; with full_logprobs, under softmax(logits / temperature) before the EOS ban and the
    filters (what the trainer computes: the behaviour log-probs of decoupled PPO, which must not carry the kept
    mass of top-k / top-p). noise: [rows, max_new_tokens] uniforms (grpo_dist.sampling_noise.row_noise), row i's
    token t drawn with noise[i, t]; None: the process RNG (then a row's draws depend on the other rows of the batch).
    compaction_threshold: finished rows leave the decode batch once they are this fraction of it
    (grpo_dist.compaction; None: never). stats, when given, gets "decode_row_steps" added: the rows computed, summed
    over the sampling steps (the prefill's last position included)."""
    logits = decoder.prefill(ids, mask, repeats, max_new_tokens)
    B = logits.shape[0]
    check_every = STOP_CHECK_EVERY
    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    rows: torch.Tensor | None = None  # after a compaction: the output row of each decode-batch row
    row_steps = 0
    for t in range(max_new_tokens):
        scores = logits.float()
        full = None if not full_logprobs else scores / temperature if do_sample and temperature != 1.0 \
            else scores.clone()
        if t < min_new_tokens:
            scores = scores.index_fill_(1, eos_ids, float("-inf"))
        if do_sample:
            if temperature != 1.0:
                scores = scores / temperature
            scores = _filter_scores(scores, top_k, top_p)
            nxt = sample_from_scores(scores, None if noise is None else noise[:, t])
        else:
            nxt = scores.argmax(-1)
        nxt = nxt.masked_fill(done, pad)
        row_steps += len(nxt)
        scored = scores if full is None else full
        if rows is None:
            tokens[:, t] = nxt
            if logprobs_out is not None:
                logprobs_out.append(_token_logprobs(scored, nxt))
        else:
            tokens[:, t].index_copy_(0, rows, nxt)
            if logprobs_out is not None:
                logprobs_out.append(torch.zeros(B, dtype=scores.dtype, device=scores.device).index_copy_(
                    0, rows, _token_logprobs(scored, nxt)))
        done |= torch.isin(nxt, eos_ids)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % check_every == 0:
            finished = int(done.sum())
            if finished == len(done):
                break
            size = should_compact(finished, len(done), compaction_threshold)
            if size is not None:
                keep = keep_rows(done, size)
                decoder.compact(keep)
                rows = keep if rows is None else rows[keep]
                done, nxt = done[keep], nxt[keep]
                noise = None if noise is None else noise[keep]
        logits = decoder.step(nxt)
    if stats is not None:
        stats["decode_row_steps"] = stats.get("decode_row_steps", 0) + row_steps
    return tokens[:, :t + 1]


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: Sequence[str | RenderedPrompt], references: list[str], *,
                      num_generations: int, max_completion_length: int, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, max_prompt_length: int = 512,
                      generation_batch_size: int | None = None,
                      min_completion_length: int = 0, do_sample: bool = True, use_hf_generate: bool = False,
                      lean_decoder: bool = True, row_seeds: Sequence[int] | None = None,
                      **generate_kwargs) -> RolloutBatch:
    """Sample num_generations completions for each prompt (rows grouped prompt by prompt).

    A lean KV-cached loop does the sampling (HF `generate` spends more time in per-token Python than in the model
    for small models: bench/generation.py), on grpo_dist.decoder.LeanDecoder where it covers the model (each prompt
    prefilled once for its G rows), else on the model's own forward (lean_decoder=False forces that). Extra keyword
    arguments (e.g. logits processors, stop strings) or use_hf_generate=True route through `model.generate` instead.
    Only temperature / top_k / top_p / min length from here apply in the lean loop; a checkpoint's
    generation_config.json sampling defaults do not. row_seeds: one per row (grpo_dist.sampling_noise.row_seeds):
    each row samples from its own noise, whatever the batch; None: the process RNG (model.generate always)."""
    device = next(model.parameters()).device
    unique_ids, unique_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device)
    ids, mask = unique_ids.repeat_interleave(num_generations, 0), unique_mask.repeat_interleave(num_generations, 0)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    eos_ids = torch.as_tensor(eos, device=device)
    chunk = generation_batch_size or len(ids)
    use_generate = use_hf_generate or bool(generate_kwargs)
    decoder = None if use_generate else make_decoder(model, ids.shape[1] + max_completion_length, lean_decoder)
    pieces = []
    for s in range(0, len(ids), chunk):
        if use_generate:
            out = model.generate(
                input_ids=ids[s:s + chunk], attention_mask=mask[s:s + chunk], do_sample=do_sample,
                temperature=temperature if do_sample else None, top_p=top_p if do_sample else None,
                top_k=(top_k or None) if do_sample else None, max_new_tokens=max_completion_length,
                min_new_tokens=min_completion_length or None, pad_token_id=pad, eos_token_id=eos,
                synced_gpus=False, use_cache=True, **generate_kwargs)
            pieces.append(out[:, ids.shape[1]:])
        else:
            # the unique prompts of rows s..s+chunk and how many of those rows continue each of them
            prompt_of_row = torch.arange(s, min(s + chunk, len(ids)), device=device) // num_generations
            uniq, repeats = torch.unique_consecutive(prompt_of_row, return_counts=True)
            # .clone() outside inference mode: the ids are later inputs of forward passes that record autograd
            pieces.append(_sample_loop(decoder, unique_ids[uniq], unique_mask[uniq], repeats,
                                       max_new_tokens=max_completion_length, temperature=temperature, top_p=top_p,
                                       top_k=top_k, min_new_tokens=min_completion_length, do_sample=do_sample,
                                       eos_ids=eos_ids, pad=pad,
                                       noise=None if row_seeds is None or not do_sample else
                                       row_noise(row_seeds[s:s + chunk], max_completion_length, device)).clone())
    width = max(p.shape[1] for p in pieces)
    completion_ids = torch.full((len(ids), width), pad, dtype=torch.long, device=device)
    row = 0
    for p in pieces:
        completion_ids[row:row + len(p), :p.shape[1]] = p
        row += len(p)
    completion_mask = completion_mask_from_ids(completion_ids, eos)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, pad))
    used = max(1, int(completion_mask.sum(-1).max()))  # columns after every row's EOS (GPU stop checks lag)
    completion_ids, completion_mask = completion_ids[:, :used], completion_mask[:, :used]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    refs = [r for r in references for _ in range(num_generations)]
    return RolloutBatch(ids, mask, completion_ids, completion_mask, num_generations, texts, refs)


def sequence_inputs(batch: RolloutBatch) -> dict:
    """Model inputs for a scoring forward pass: ids, mask and position ids that skip the left padding."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def completion_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits that predict each completion token: [N, C, V], contiguous. Only the C positions that predict a
    completion token are projected onto the vocabulary (logits_to_keep as an index tensor), so prompt positions and
    the last position never cost a [*, vocab] tensor, and no slice copy of the logits is needed later."""
    p, c = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    keep = torch.arange(p - 1, p + c - 1, device=batch.completion_ids.device)
    out = model(**sequence_inputs(batch), logits_to_keep=keep, use_cache=False)
    n = out.logits.shape[1]
    if n == c:
        return out.logits
    if n == p + c:  # a model that ignores logits_to_keep: every position came back
        return out.logits[:, p - 1:-1]
    raise ValueError(f"{type(model).__name__} returned logits for {n} positions with logits_to_keep of {c} indices")

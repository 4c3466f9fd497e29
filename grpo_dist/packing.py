"""Padding-free passes (config key padding_free): the reference, old-policy and training forwards run on the rows
of a micro-batch concatenated into one row (batch of 1), position_ids restarting at 0 at each sequence, no
attention mask. transformers then builds the block-diagonal causal mask from the position_ids (sdpa, eager) or
runs its varlen kernels (flash attention), so no pad token enters a matmul.

On sdpa that mask is dense: a packed row of T tokens costs T x T attention scores whatever its sequences, which on
a CPU (no varlen kernel) makes a micro-batch of many short sequences slower than padding them. So the packed
forwards also pass the sequence boundaries the way transformers' flash-attention path takes them (cu_seq_lens_q /
cu_seq_lens_k, max_length_q / max_length_k), and the "sdpa" attention function is wrapped to run one causal sdpa
per sequence when it sees them (any other call goes to transformers' own sdpa unchanged): attention then costs the
sum of the sequences' squares, as with varlen flash attention.

The trap (issue 29): transformers detects packing only when the forward has no cache. With the default use_cache
(True, even in train mode) the model builds a cache, skips the detection, and the second sequence silently attends
to the first. Every packed forward here passes use_cache=False (tests/test_packing.py shows the difference).

Pure tensor code, no torch.distributed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_dist.prompt_sharing import AttentionPlan, shared_attention, shared_layout
from grpo_dist.rollout import RolloutBatch, completion_logits

# attention implementations whose transformers path reads packed sequences from position_ids
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PLAN_KWARG = "shared_prompt_plan"  # the forward kwarg that carries a prompt_sharing.AttentionPlan to the attention


def _sdpa_by_sequence(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, one causal call per packed sequence when the forward carries the sequence
    boundaries (cu_seq_lens_q, module docstring), else transformers' own call unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    plan = kwargs.pop(PLAN_KWARG, None)
    if plan is not None:
        rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS and k != "is_causal"}
        return shared_attention(module, query, key, value, plan, sdpa_attention_forward, dropout=dropout,
                                scaling=scaling, **rest)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1 or key.shape[2] != query.shape[2] or \
            kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS and k != "is_causal"}
    bounds = cu.tolist()
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # split, not one slice per sequence: a slice's backward writes its gradient into a zero tensor of the whole
    # row, so N sequences cost N full-size tensors per layer; split's backward is one concatenation
    out = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **rest)[0]
           for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))]
    return torch.cat(out, dim=1), None  # [1, T, heads, head_dim], as sdpa_attention_forward returns


def install_sdpa_by_sequence() -> None:
    """Put _sdpa_by_sequence in transformers' attention registry as "sdpa" (once per process; calls without the
    varlen kwargs behave as before)."""
    from transformers.modeling_utils import AttentionInterface
    if AttentionInterface._global_mapping.get("sdpa") is not _sdpa_by_sequence:
        AttentionInterface.register("sdpa", _sdpa_by_sequence)


def unsupported_reason(model) -> str | None:
    """Why this model cannot run packed rows (None: it can): its attention implementation must be one that reads
    packing from position_ids, and its modeling code must build its mask with transformers' create_causal_mask
    (which does that detection)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return f"attention implementation {impl!r} is not one of {', '.join(PACKING_ATTENTION)}"
    module = sys.modules.get(type(model).__module__)
    if module is None or not hasattr(module, "create_causal_mask"):
        return f"{type(model).__name__} does not build its mask with transformers' create_causal_mask"
    return None


def share_prompts_reason(model) -> str | None:
    """Why rows that share a prompt cannot read one copy of it in this model (None: they can): only grpo_dist's
    sdpa function runs that attention (prompt_sharing.py)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        return f"attention implementation {impl!r} is not sdpa"
    if getattr(getattr(model, "config", None), "sliding_window", None) and \
            getattr(model.config, "use_sliding_window", True):
        return "the model attends over a sliding window"
    return None


def fallback_line(model) -> str | None:
    """The one line that says padding_free falls back to padded rows for this model, or None when it can pack."""
    why = unsupported_reason(model)
    return None if why is None else f"[grpo_dist] padding_free: {why}; the log-prob and training passes run on " \
        f"padded rows"


@dataclass
class PackedRows:
    """A micro-batch's rows as one packed row: ids [1, T] and position_ids [1, T] of every real token (prompt then
    completion, row after row), `keep` [L]: the stream positions that predict a completion token, `labels` [L]:
    those tokens, `index` [L]: where each sits in the row-major [N, C] completion layout."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    shape: tuple[int, int]
    cu_seq_lens: torch.Tensor  # [rows + 1] int32: where each sequence starts in the stream, then T
    max_length: int
    plan: AttentionPlan | None = None  # share_prompts: the attention of rows that share a prompt (prompt_sharing.py)


def pack_rows(batch: RolloutBatch, share_prompts: bool = False) -> PackedRows:
    """The real tokens of each row (left-padded prompt, right-padded completion) back to back; with share_prompts,
    rows with the same prompt read one copy of it (prompt_sharing.py)."""
    if len(batch) and not bool(batch.prompt_mask.any(-1).all()):
        raise ValueError("padding_free needs at least one prompt token per row (the first completion token is "
                         "predicted from the prompt's last)")
    if share_prompts:
        return _pack_shared(batch)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).bool()
    positions = mask.long().cumsum(-1) - 1
    is_completion = torch.cat([torch.zeros_like(batch.prompt_mask), batch.completion_mask], dim=1).bool()
    # row-major selection keeps each row's prompt tokens, then its completion tokens, row after row
    stream_ids, stream_pos, stream_comp = ids[mask], positions[mask], is_completion[mask]
    keep = stream_comp.nonzero().squeeze(-1) - 1  # position k predicts the token at k + 1
    seq_lens = mask.sum(-1)
    cu = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).to(torch.int32)
    return PackedRows(stream_ids[None], stream_pos[None], keep, stream_ids[keep + 1],
                      batch.completion_mask.bool().flatten().nonzero().squeeze(-1),
                      (batch.completion_ids.shape[0], batch.completion_ids.shape[1]), cu,
                      int(seq_lens.max()) if len(seq_lens) else 0)


def _pack_shared(batch: RolloutBatch) -> PackedRows:
    """pack_rows with one prompt per group; keep, labels and index in the row-major order of pack_rows."""
    layout = shared_layout(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    device = batch.prompt_ids.device
    ids = torch.tensor(layout.input_ids, dtype=torch.long, device=device)
    keep = torch.tensor([k for r in range(len(batch)) for k in layout.keep[r]], dtype=torch.long, device=device)
    labels = batch.completion_ids[batch.completion_mask.bool()]  # row-major, as keep
    bounds = [0] + [qe for _, qe, _, _ in layout.calls]
    return PackedRows(ids[None], torch.tensor(layout.position_ids, dtype=torch.long, device=device)[None], keep,
                      labels, batch.completion_mask.bool().flatten().nonzero().squeeze(-1),
                      (batch.completion_ids.shape[0], batch.completion_ids.shape[1]),
                      torch.tensor(bounds, dtype=torch.int32, device=device),
                      max(b - a for a, b in zip(bounds[:-1], bounds[1:])) if len(bounds) > 1 else 0,
                      AttentionPlan(layout.calls))


def packed_logits(model, packed: PackedRows) -> torch.Tensor:
    """[L, V] logits of the completion positions of a packed micro-batch (contiguous). use_cache=False is what
    makes transformers honour the sequence boundaries (module docstring)."""
    install_sdpa_by_sequence()
    if packed.plan is not None:
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.keep,
                    use_cache=False, **{PLAN_KWARG: packed.plan})
        if not packed.plan.consumed:  # the attention never read the plan: it attended some other way
            raise RuntimeError(f"share_prompts: {type(model).__name__}'s attention did not run grpo_dist's sdpa "
                               f"function, so shared prompts would be attended wrongly; set share_prompts=false")
    else:
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.keep,
                    use_cache=False, cu_seq_lens_q=packed.cu_seq_lens, cu_seq_lens_k=packed.cu_seq_lens,
                    max_length_q=packed.max_length, max_length_k=packed.max_length)
    n = out.logits.shape[1]
    if n == len(packed.keep):
        return out.logits[0]
    if n == packed.input_ids.shape[1]:  # a model that ignores logits_to_keep
        return out.logits[0, packed.keep].contiguous()
    raise ValueError(f"{type(model).__name__} returned logits for {n} positions with logits_to_keep of "
                     f"{len(packed.keep)} indices")


def unpack(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """[L] per-token values -> [N, C], zero at padding (differentiable: the loss code keeps its [B, T] layout)."""
    n, c = packed.shape
    return values.new_zeros(n * c).index_copy(0, packed.index, values).view(n, c)


@dataclass
class PassTokens:
    """Tokens a pass computed (every position of every forward), the tokens it needed (the rows' real ones), and the
    prompt tokens that share_prompts did not compute again: processed + shared - useful is the padding."""
    processed: int = 0
    useful: int = 0
    shared: int = 0


def completion_forward(model, mb: RolloutBatch, padding_free: bool, count: PassTokens | None = None,
                       share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """(logits, labels, to_rows) of one micro-batch: padded, logits [N, C, V] and labels [N, C]; padding-free,
    logits [L, V] and labels [L] of the real completion tokens only (with share_prompts, rows with the same prompt
    read one copy of it). to_rows brings per-token values of the labels' shape to the [N, C] layout of the batch.
    count, when given, receives the pass's token counts."""
    useful = int(mb.prompt_mask.sum()) + int(mb.completion_mask.sum())
    if not padding_free:
        if count is not None:
            count.processed += len(mb) * (mb.prompt_ids.shape[1] + mb.completion_ids.shape[1])
            count.useful += useful
        return completion_logits(model, mb), mb.completion_ids, lambda v: v
    packed = pack_rows(mb, share_prompts)
    if count is not None:
        count.processed += packed.input_ids.shape[1]
        count.useful += useful
        count.shared += useful - packed.input_ids.shape[1]
    return packed_logits(model, packed), packed.labels, lambda v: unpack(v, packed)

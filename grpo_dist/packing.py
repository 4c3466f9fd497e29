"""Padding-free passes (config key padding_free): the reference, old-policy and training forwards run on the rows
of a micro-batch concatenated into one row (batch of 1), position_ids restarting at 0 at each sequence, no pad
token in any matmul of the projections and MLPs.

Attention: one call per layer (issue 37). transformers' sdpa path would build a dense [T, T] block-diagonal mask
from the position_ids (T x T scores whatever the sequences); the earlier code here ran one causal sdpa call per
sequence instead (N calls per layer, nearly every shape new each step: on a GPU, cuDNN SDPA builds a plan per new
shape). Now the packed forward carries an AttentionRows plan, built once per micro-batch from host copies, and the
"sdpa" attention function (wrapped here; any call without a plan goes to transformers' own sdpa unchanged) gathers
the stream into at most two padded batches of "attention rows" (a sequence, or a shared prompt then one of its
completions: prompt_sharing.py), sorted by length and cut where n1 L1^2 + n2 L2^2 is least, and runs one causal
sdpa call on each. Right padding needs no mask under causal attention (a real query never reads a later key), so
the call can use the flash kernels (CPU and CUDA). On CUDA the backends are named explicitly (flash, then
memory-efficient, then math; never cuDNN, which builds a graph per new shape). Measured on a CPU (64 rows, lengths
median ~200, p95 ~900, cap 1024, 17k tokens; forward + backward of the attention alone, 1 thread, shared box):
per-sequence calls 0.09 s, one padded call 0.61 s, two length buckets 0.22 s, one sdpa with a dense block mask
0.36 s at 4.4k tokens (quadratic in the stream), FlexAttention: no backward on CPU; torch.nn.attention.varlen:
CUDA only. The two buckets cost ~2.5x the per-sequence attention FLOPs at these lengths (the padding of each
bucket), a small share of a step beside the projections, MLPs and LM head.

flash_attention_2/3 implementations keep transformers' own varlen path (cu_seq_lens_q / cu_seq_lens_k are passed
as well); eager attention keeps transformers' block-diagonal mask.

The trap (issue 29): transformers detects packing only when the forward has no cache. With the default use_cache
(True, even in train mode) the model builds a cache, skips the detection, and the second sequence silently attends
to the first. Every packed forward here passes use_cache=False (tests/test_packing.py shows the difference).

Pure tensor code, no torch.distributed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_dist.logprobs import fused_head_reason, head_log_probs, selective_log_probs, selective_log_probs_and_entropy
from grpo_dist.prompt_sharing import Row, shared_layout
from grpo_dist.rollout import RolloutBatch, completion_logits

# attention implementations whose transformers path reads packed sequences from position_ids
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PLAN_KWARG = "packed_attention_plan"  # the forward kwarg that carries an AttentionRows plan to the attention
MAX_BUCKETS = 2  # attention calls per layer at most


class AttentionRows:
    """The attention of one packed forward, built once per micro-batch and read by every layer of every pass:
    `buckets` [(rows, length, gather index [rows x length] of stream positions)], each one padded causal batch
    (padding slots read position 0: only padding queries see them, and their outputs are dropped); `owner` [T]:
    where each stream position's output sits in the buckets' outputs laid end to end. `consumed` counts the layers
    that ran it; `shared` says a forward that never did must be refused (shared prompts attended as one sequence)."""

    def __init__(self, rows: list[Row], total: int, device, shared: bool):
        lengths = [sum(b - a for a, b in ranges) for ranges, _ in rows]
        order = sorted(range(len(rows)), key=lambda i: lengths[i])
        cut = _bucket_cut([lengths[i] for i in order])
        self.buckets: list[tuple[int, int, torch.Tensor]] = []
        owner = torch.zeros(total, dtype=torch.long)
        flat = 0
        for part in (order[:cut], order[cut:]):
            if not part:
                continue
            size = max(lengths[i] for i in part)
            index = torch.zeros(len(part), size, dtype=torch.long)
            for j, i in enumerate(part):
                ranges, own = rows[i]
                pos = torch.cat([torch.arange(a, b) for a, b in ranges])
                index[j, :len(pos)] = pos
                owner[pos[own:]] = flat + j * size + torch.arange(own, len(pos))
            self.buckets.append((len(part), size, index.flatten().to(device)))
            flat += len(part) * size
        self.owner = owner.to(device)
        self.shared, self.consumed = shared, 0
        self.unmasked = False  # set by _run_packed: the forward's block-diagonal mask was not built

    @property
    def calls(self) -> int:
        return len(self.buckets)


def _bucket_cut(lengths: list[int]) -> int:
    """Where to cut rows sorted by length into two padded batches: the cut that minimises the attention scores
    computed, n1 L1^2 + n2 L2^2 (0: one batch)."""
    if MAX_BUCKETS < 2 or len(lengths) < 2:
        return 0
    n, top = len(lengths), lengths[-1]
    costs = [(c * lengths[c - 1] ** 2 + (n - c) * top ** 2, c) for c in range(1, n)]
    best = min(costs)
    return best[1] if best[0] < n * top ** 2 else 0


def _backends():
    """On CUDA, the sdpa backends named explicitly: flash, memory-efficient, math; not cuDNN, which builds a
    graph for every new shape (a packed micro-batch's shapes change every step). Nothing to pick on a CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                       set_priority=True)


def rows_attention(module, query, key, value, plan: AttentionRows, sdpa, **kwargs):
    """The attention of a packed stream (query/key/value [1, heads, T, dim]) as `plan` says: one causal `sdpa`
    (transformers' sdpa attention function) per bucket of padded attention rows; returns [1, T, heads, dim] in
    stream order, as sdpa_attention_forward does. Index ops only: no host sync, no per-row loop."""
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or kwargs.get("sliding_window") is not None:
        raise ValueError("padding_free: a packed forward needs one row of self-attention without a sliding window "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)}, sliding_window "
                         f"{kwargs.get('sliding_window')}); set padding_free=false")
    outs = []
    pick = _backends() if query.is_cuda else contextlib.nullcontext()
    with pick:
        for n, size, index in plan.buckets:
            q, k, v = (x[0].index_select(1, index).unflatten(1, (n, size)).transpose(0, 1)
                       for x in (query, key, value))
            out = sdpa(module, q, k, v, None, is_causal=True, **kwargs)[0]  # [n, size, heads, dim]
            outs.append(out.reshape(n * size, *out.shape[2:]))
    plan.consumed += 1
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, plan.owner)[None], None


def _sdpa_packed(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention; a packed forward (its AttentionRows plan in the kwargs) runs rows_attention
    instead (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    plan = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    why = _rows_reason(query, key, kwargs)
    if why is not None and plan.unmasked:  # _run_packed's promise broken: no mask to fall back on
        raise RuntimeError(f"packed attention: {why}, and transformers' block-diagonal mask was not built")
    if why is not None and not plan.shared:  # transformers' block-diagonal mask from the position_ids is right
        _say_once(f"[grpo_dist] packed attention: {why}; this layer runs transformers' sdpa with its dense "
                  f"block-diagonal mask")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS and k != "is_causal"}
    return rows_attention(module, query, key, value, plan, sdpa_attention_forward, dropout=dropout,
                          scaling=scaling, **rest)


def _rows_reason(query, key, kwargs) -> str | None:
    """Why rows_attention cannot run this layer (None: it can)."""
    if kwargs.get("sliding_window") is not None:
        return "the layer attends over a sliding window"
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return f"query {tuple(query.shape)} and key {tuple(key.shape)} are not one packed row of self-attention"
    return None


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, flush=True)


def install_sdpa_packed() -> None:
    """Put _sdpa_packed in transformers' attention registry as "sdpa" (once per process; calls without a plan
    behave as before)."""
    from transformers.modeling_utils import AttentionInterface
    if AttentionInterface._global_mapping.get("sdpa") is not _sdpa_packed:
        AttentionInterface.register("sdpa", _sdpa_packed)


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
    those tokens, `index` [L]: where each sits in the row-major [N, C] completion layout. Built once per step from
    host copies (pack_rows) and read by every pass and iteration without a host sync."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    shape: tuple[int, int]
    cu_seq_lens: torch.Tensor  # [sequences + 1] int32: where each sequence starts in the stream, then T
    max_length: int
    plan: AttentionRows  # the attention (module docstring); plan.shared with share_prompts (prompt_sharing.py)
    useful: int = 0  # the rows' real tokens (prompt + completion each), for PassTokens


def pack_rows(batch: RolloutBatch, share_prompts: bool = False) -> PackedRows:
    """The real tokens of each row (left-padded prompt, right-padded completion) back to back; with share_prompts,
    rows with the same prompt read one copy of it (prompt_sharing.py). Built on a host copy of the batch (one copy
    back from the device), moved to the batch's device once."""
    device = batch.prompt_ids.device
    batch = batch.to("cpu")
    if len(batch) and not bool(batch.prompt_mask.any(-1).all()):
        raise ValueError("padding_free needs at least one prompt token per row (the first completion token is "
                         "predicted from the prompt's last)")
    useful = int(batch.prompt_mask.sum()) + int(batch.completion_mask.sum())
    index = batch.completion_mask.bool().flatten().nonzero().squeeze(-1)
    shape = (batch.completion_ids.shape[0], batch.completion_ids.shape[1])
    if share_prompts:
        layout = shared_layout(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        ids = torch.tensor(layout.input_ids, dtype=torch.long)
        pos = torch.tensor(layout.position_ids, dtype=torch.long)
        keep = torch.tensor([k for r in range(len(batch)) for k in layout.keep[r]], dtype=torch.long)
        labels = batch.completion_ids[batch.completion_mask.bool()]  # row-major, as keep
        rows = layout.rows
    else:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).bool()
        positions = mask.long().cumsum(-1) - 1
        is_completion = torch.cat([torch.zeros_like(batch.prompt_mask), batch.completion_mask], dim=1).bool()
        # row-major selection keeps each row's prompt tokens, then its completion tokens, row after row
        ids, pos, comp = ids[mask], positions[mask], is_completion[mask]
        keep = comp.nonzero().squeeze(-1) - 1  # position k predicts the token at k + 1
        labels = ids[keep + 1]
        ends = mask.sum(-1).cumsum(0).tolist()
        rows = [([(a, b)], 0) for a, b in zip([0] + ends[:-1], ends)]
    seqs = [r for r, _ in rows]
    bounds = [0] + [r[-1][1] for r in seqs]
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    plan = AttentionRows(rows, len(ids), device, share_prompts)
    return PackedRows(ids[None].to(device), pos[None].to(device), keep.to(device), labels.to(device),
                      index.to(device), shape, cu.to(device), longest, plan, useful)


def _packed_inputs(packed: PackedRows) -> dict:
    """The forward's kwargs: use_cache=False is what makes transformers honour the sequence boundaries (module
    docstring); the plan goes to the sdpa function, the varlen kwargs to transformers' flash-attention path."""
    return dict(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.keep,
                use_cache=False, cu_seq_lens_q=packed.cu_seq_lens, cu_seq_lens_k=packed.cu_seq_lens,
                max_length_q=packed.max_length, max_length_k=packed.max_length, **{PLAN_KWARG: packed.plan})


# The attention_mask of a packed forward whose every layer runs rows_attention (sdpa, no sliding window): a 4-D
# mask is what transformers' create_causal_mask hands back as it is, so the [T, T] block-diagonal mask it would
# build from the position_ids (O(T^2) work and a host sync per forward) is never built; nothing reads it.
_UNREAD_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def _run_packed(model, packed: PackedRows):
    install_sdpa_packed()
    seen = packed.plan.consumed
    inputs = _packed_inputs(packed)
    unread = share_prompts_reason(model) is None  # sdpa without a sliding window: every layer reads the plan
    if unread:
        inputs["attention_mask"] = _UNREAD_MASK
    packed.plan.unmasked = unread
    out = model(**inputs)
    if packed.plan.consumed == seen and (packed.plan.shared or unread):  # the attention never read the plan
        what = "shared prompts" if packed.plan.shared else "packed rows"
        raise RuntimeError(f"{type(model).__name__}'s attention did not run grpo_dist's sdpa function, so "
                           f"{what} would be attended wrongly; set share_prompts=false and padding_free=false")
    return out


def packed_logits(model, packed: PackedRows) -> torch.Tensor:
    """[L, V] logits of the completion positions of a packed micro-batch (contiguous)."""
    out = _run_packed(model, packed)
    n = out.logits.shape[1]
    if n == len(packed.keep):
        return out.logits[0]
    if n == packed.input_ids.shape[1]:  # a model that ignores logits_to_keep
        return out.logits[0, packed.keep].contiguous()
    raise ValueError(f"{type(model).__name__} returned logits for {n} positions with logits_to_keep of "
                     f"{len(packed.keep)} indices")


@contextlib.contextmanager
def fused_head(model, labels: torch.Tensor, temperature: float, chunk_size: int | None, entropy: str | None):
    """For the forward inside it, the model's LM head returns [1, L, 1] log-probs of `labels` (or [1, L, 2]: log-prob
    and entropy) from logprobs.head_log_probs instead of [1, L, V] logits. The head module itself is called by the
    model's forward, so an FSDP root has its weight gathered there and again for the backward."""
    head = model.get_output_embeddings()

    def forward(hidden):
        logp, ent = head_log_probs(hidden[0], head.weight, head.bias, labels, temperature, chunk_size,
                                   entropy=entropy)
        return (logp[:, None] if ent is None else torch.stack([logp, ent.to(logp.dtype)], -1))[None]
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def fused_reason(model) -> str | None:
    """Why the fused LM head is not used for this model (None: it is); said once per reason."""
    why = fused_head_reason(model)
    if why is not None:
        _say_once(f"[grpo_dist] fused LM head: {why}; the log-prob passes compute the micro-batch's full logits")
    return why


def packed_log_probs(model, packed: PackedRows, temperature: float = 1.0, chunk_size: int | None = None,
                     entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([L] log-probs of the labels, [L] entropies or None) of a packed micro-batch. entropy: None, "metric" (no
    gradient) or "grad" (differentiable, for the entropy bonus). Through the fused LM head where the model allows
    (no [L, V] tensor exists), else from the full logits."""
    if fused_reason(model) is None:
        with fused_head(model, packed.labels, temperature, chunk_size, entropy):
            out = _run_packed(model, packed).logits[0]
        if out.shape[0] != len(packed.keep):
            raise ValueError(f"{type(model).__name__} returned {out.shape[0]} positions with logits_to_keep of "
                             f"{len(packed.keep)} indices")
        return out[:, 0], (out[:, 1] if entropy is not None else None)
    return logits_log_probs(packed_logits(model, packed), packed.labels, temperature, chunk_size, entropy)


def logits_log_probs(logits, labels, temperature, chunk_size, entropy):
    """(log-probs, entropies or None) from full logits (logprobs.py; overwrite_logits: nothing reads them after)."""
    if entropy == "grad":
        return selective_log_probs_and_entropy(logits, labels, chunk_size, temperature, overwrite_logits=True)
    ent = torch.empty(labels.shape, device=logits.device) if entropy == "metric" else None
    return selective_log_probs(logits, labels, chunk_size, temperature, overwrite_logits=True, entropy_out=ent), ent


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


def _count(count: PassTokens | None, mb: RolloutBatch, padding_free: bool, packed: PackedRows | None) -> None:
    if count is None:
        return
    if packed is not None:
        count.processed += packed.input_ids.shape[1]
        count.useful += packed.useful
        count.shared += packed.useful - packed.input_ids.shape[1]
    else:
        count.processed += len(mb) * (mb.prompt_ids.shape[1] + mb.completion_ids.shape[1])
        count.useful += int(mb.prompt_mask.sum()) + int(mb.completion_mask.sum())


def completion_forward(model, mb: RolloutBatch, padding_free: bool, count: PassTokens | None = None,
                       share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """(logits, labels, to_rows) of one micro-batch: padded, logits [N, C, V] and labels [N, C]; padding-free,
    logits [L, V] and labels [L] of the real completion tokens only (with share_prompts, rows with the same prompt
    read one copy of it). to_rows brings per-token values of the labels' shape to the [N, C] layout of the batch.
    count, when given, receives the pass's token counts."""
    if not padding_free:
        _count(count, mb, False, None)
        return completion_logits(model, mb), mb.completion_ids, lambda v: v
    packed = pack_rows(mb, share_prompts)
    _count(count, mb, True, packed)
    return packed_logits(model, packed), packed.labels, lambda v: unpack(v, packed)


def completion_log_probs(model, mb: RolloutBatch, packed: PackedRows | None, count: PassTokens | None = None,
                         temperature: float = 1.0, chunk_size: int | None = None,
                         entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N, C] log-probs of the completion tokens, [N, C] entropies or None) of one micro-batch: packed (its
    layout built once per step by pack_rows) through the fused LM head, or padded (packed None) from the logits.
    entropy as packed_log_probs; count receives the pass's token counts."""
    _count(count, mb, packed is not None, packed)
    if packed is None:
        return logits_log_probs(completion_logits(model, mb), mb.completion_ids, temperature, chunk_size, entropy)
    logp, ent = packed_log_probs(model, packed, temperature, chunk_size, entropy)
    return unpack(logp, packed), (unpack(ent, packed) if ent is not None else None)

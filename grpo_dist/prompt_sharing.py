"""Shared prompts in the packed passes (config key share_prompts): the G completions of one prompt attend to one copy
of its tokens, so a group costs prompt + the completions' tokens instead of G x (prompt + completion).

GRPO samples num_generations completions of every prompt, and the reference, old-policy and training passes run
each row's prompt again: with a chat template and a short answer the prompt is most of every row (the real-model
demo: 42 prompt tokens against ~13 completion tokens, 76 % of the tokens computed). Packed (packing.py), a group
of rows that share a prompt becomes one prefix segment (positions 0..p-1) followed by its completions (positions
p..p+c-1 each), and the attention of a completion reads the prefix's keys and values and its own, causally:

    stream   [ prompt A | a1 | a2 | a3 ][ prompt B | b1 | b2 ] ...
    a2 sees  [ prompt A |    | a2 |    ]                           (a2 causal over itself)

The first completion token of every row is predicted from the prefix's last position (logits_to_keep may name a
position several times). Everything per row downstream (log-probs, entropies, the loss, its gradient) is the same
function of the same numbers as with separate rows: the prefix's keys and values are what each row's own forward
computes at those positions (same tokens, same positions), and the gradient that reaches a prompt token is the sum
over the rows that read it, which is what separate rows add up in the weights (tests/test_prompt_sharing.py: 1e-5
in fp32 on the tiny and the real model).

Only packing.py's sdpa function can run this attention (one sdpa call per prefix, and per group of completions
with a small boolean mask built once per micro-batch, not per layer); a model whose attention does not reach it
would silently compute something else, so a forward that did not consume its plan raises. Pure tensor code.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

# Completions of one group go into one attention call while its mask (queries x keys) stays under this many
# elements; past it, each completion gets its own call (long completions: the mask and the attention scores of one
# call stay bounded).
MAX_MASK_ELEMENTS = 1 << 22


class AttentionPlan:
    """The attention calls of one packed forward, built once and read by every layer: each call is (first query,
    end query, key ranges, mask [queries, keys] bool or None for plain causal). The calls' query ranges tile the
    stream in order. `consumed` counts the layers that ran the plan (a forward that never did is refused)."""

    def __init__(self, calls: list[tuple[int, int, list[tuple[int, int]], torch.Tensor | None]]):
        self.calls = calls
        self.consumed = 0
        # every boundary of a query or key range: the stream is split there once per layer (_pieces)
        self.points = sorted({p for qs, qe, ranges, _ in calls for p in (qs, qe, *(x for r in ranges for x in r))})


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  rows: list[int] | None = None) -> list[list[int]]:
    """The rows (all, or those named) with the same prompt tokens, groups in order of first appearance, rows in
    order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(prompt_ids.shape[0]) if rows is None else rows:
        groups.setdefault(tuple(prompt_ids[i][prompt_mask[i].bool()].tolist()), []).append(i)
    return list(groups.values())


def group_order(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[int],
                lengths: dict[int, tuple[int, int]]) -> list[int]:
    """`rows` with the rows of each prompt together (groups by their total tokens, shortest first; rows by
    length): contiguous slices of it keep groups whole where the slice size allows."""
    groups = [sorted(g, key=lambda r: (sum(lengths[r]), r)) for g in prompt_groups(prompt_ids, prompt_mask, rows)]
    groups.sort(key=lambda g: (sum(lengths[r][1] for r in g) + lengths[g[0]][0], g[0]))
    return [r for g in groups for r in g]


@dataclass
class SharedLayout:
    """What pack_rows needs to build the stream of a micro-batch whose rows share prompts."""
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    keep: dict[int, list[int]] = field(default_factory=dict)  # row -> stream positions predicting its tokens
    calls: list = field(default_factory=list)


def _completion_calls(start: int, prefix: tuple[int, int], lens: list[int], device) -> list:
    """Attention calls for completions laid out from `start`, of lengths `lens`, all reading `prefix`: as many
    completions per call as MAX_MASK_ELEMENTS allows, each causal over itself and reading the whole prefix."""
    calls, i, p = [], 0, prefix[1] - prefix[0]
    while i < len(lens):
        j, q = i + 1, lens[i]
        while j < len(lens) and (q + lens[j]) * (p + q + lens[j]) <= MAX_MASK_ELEMENTS:
            q += lens[j]
            j += 1
        mask = torch.zeros(q, p + q, dtype=torch.bool, device=device)
        mask[:, :p] = True
        off = 0
        for n in lens[i:j]:
            mask[off:off + n, p + off:p + off + n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            off += n
        calls.append((start, start + q, [prefix, (start, start + q)], mask))
        start += q
        i = j
    return calls


def shared_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> SharedLayout:
    """The packed stream with one prompt per group: a group of one row is its prompt and completion as one causal
    segment; a larger group is its prompt, then its rows' completions (module docstring)."""
    out = SharedLayout()
    device = prompt_ids.device
    for group in prompt_groups(prompt_ids, prompt_mask):
        prompt = prompt_ids[group[0]][prompt_mask[group[0]].bool()].tolist()
        p = len(prompt)
        comps = [completion_ids[r][completion_mask[r].bool()].tolist() for r in group]
        start = len(out.input_ids)
        if len(group) == 1:
            c = len(comps[0])
            out.input_ids += prompt + comps[0]
            out.position_ids += list(range(p + c))
            out.keep[group[0]] = list(range(start + p - 1, start + p + c - 1))
            out.calls.append((start, start + p + c, [(start, start + p + c)], None))
            continue
        out.input_ids += prompt
        out.position_ids += list(range(p))
        out.calls.append((start, start + p, [(start, start + p)], None))
        at, lens = start + p, []
        for r, comp in zip(group, comps):
            c = len(comp)
            out.input_ids += comp
            out.position_ids += list(range(p, p + c))
            out.keep[r] = ([start + p - 1] + list(range(at, at + c - 1))) if c else []
            at += c
            if c:
                lens.append(c)
        out.calls += _completion_calls(start + p, (start, start + p), lens, device)
    return out


def shared_attention(module, query, key, value, plan: AttentionPlan, sdpa, **kwargs):
    """The attention of a shared-prompt stream (query/key/value [1, heads, T, dim]): `sdpa` (transformers' sdpa
    attention function) once per call of the plan, the outputs back in stream order."""
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or kwargs.get("sliding_window") is not None:
        raise ValueError("share_prompts: a shared-prompt forward needs one packed row of self-attention without a "
                         f"sliding window (query {tuple(query.shape)}, key {tuple(key.shape)}, sliding_window "
                         f"{kwargs.get('sliding_window')}); set share_prompts=false")
    queries, keys, values = (_pieces(x, plan.points) for x in (query, key, value))
    out = []
    for qs, qe, ranges, mask in plan.calls:
        q = _join(queries, plan.points, [(qs, qe)])
        k, v = _join(keys, plan.points, ranges), _join(values, plan.points, ranges)
        if mask is None:
            out.append(sdpa(module, q, k, v, None, is_causal=True, **kwargs)[0])
        else:
            out.append(sdpa(module, q, k, v, mask[None, None], is_causal=False, **kwargs)[0])
    plan.consumed += 1
    return torch.cat(out, dim=1), None  # [1, T, heads, dim], as sdpa_attention_forward returns


def _pieces(x: torch.Tensor, points: list[int]) -> dict[int, torch.Tensor]:
    """x [1, heads, T, dim] split at the plan's points, by start. One split, not a slice per call: a slice's
    backward writes its gradient into a zero tensor the size of the whole stream, so a plan of N calls would cost
    N such tensors per layer (quadratic in the sequences of a micro-batch); split's backward is one concatenation."""
    sizes = [b - a for a, b in zip(points[:-1], points[1:])]
    return dict(zip(points[:-1], x.split(sizes, dim=2)))


def _join(pieces: dict[int, torch.Tensor], points: list[int], ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The stream's positions of `ranges`, in order, from its pieces."""
    parts = [pieces[points[i]] for a, b in ranges for i in range(bisect.bisect_left(points, a),
                                                                    bisect.bisect_left(points, b))]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

"""Shared prompts in the packed passes (config key share_prompts): the G completions of one prompt read one copy
of its tokens, so a group costs prompt + the completions' tokens instead of G x (prompt + completion) in every
layer's projections and MLP.

GRPO samples num_generations completions of every prompt, and the reference, old-policy and training passes run
each row's prompt again: with a chat template and a short answer the prompt is most of every row (the real-model
demo: 42 prompt tokens against ~13 completion tokens, 76 % of the tokens computed). Packed (packing.py), a group
of rows that share a prompt becomes one prefix segment (positions 0..p-1) followed by its completions (positions
p..p+c-1 each):

    stream   [ prompt A | a1 | a2 | a3 ][ prompt B | b1 | b2 ] ...
    a2 sees  [ prompt A |    | a2 |    ]                           (a2 causal over itself)

In the attention (packing.py: one call per layer over "attention rows"), each completion is one row made of the
prefix's keys, values and queries followed by its own: plain causal attention over [prompt, completion]. The
prefix's queries are attended again in each row (only the attention scores, not the projections or the MLP) and
the first row's outputs are the ones kept, so no mask is needed and no completion reads another.

The first completion token of every row is predicted from the prefix's last position (logits_to_keep may name a
position several times). Everything per row downstream (log-probs, entropies, the loss, its gradient) is the same
function of the same numbers as with separate rows: the prefix's keys and values are what each row's own forward
computes at those positions (same tokens, same positions), and the gradient that reaches a prompt token is the sum
over the rows that read it, which is what separate rows add up in the weights (tests/test_prompt_sharing.py: 1e-5
in fp32 on the tiny and the real model).

Only packing.py's sdpa function can run this attention; a model whose attention does not reach it would silently
compute something else, so a shared forward that did not consume its plan raises. Pure tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# an attention row: its stream ranges in order (attended as one causal sequence) and the first of its positions
# whose output it owns (the rows after a group's first re-attend the prompt but keep only their completion)
Row = tuple[list[tuple[int, int]], int]


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
    """What pack_rows needs to build the stream of a micro-batch whose rows share prompts (host lists)."""
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    keep: dict[int, list[int]] = field(default_factory=dict)  # row -> stream positions predicting its tokens
    rows: list[Row] = field(default_factory=list)  # the attention rows (module docstring)


def shared_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> SharedLayout:
    """The packed stream with one prompt per group (host tensors): a group of one row is its prompt and completion
    as one causal segment; a larger group is its prompt, then its rows' completions, each completion one attention
    row over [prompt, completion] (module docstring)."""
    out = SharedLayout()
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
            out.rows.append(([(start, start + p + c)], 0))
            continue
        out.input_ids += prompt
        out.position_ids += list(range(p))
        at, first = start + p, True
        for r, comp in zip(group, comps):
            c = len(comp)
            out.input_ids += comp
            out.position_ids += list(range(p, p + c))
            out.keep[r] = ([start + p - 1] + list(range(at, at + c - 1))) if c else []
            if c:  # the group's first row owns the prompt's outputs, the others only their completion's
                out.rows.append(([(start, start + p), (at, at + c)], 0 if first else p))
                first = False
            at += c
        if first:  # no completion token in the group: the prompt alone
            out.rows.append(([(start, start + p)], 0))
    return out

"""Micro-batches by token budget (config key max_tokens_per_micro_batch; micro_batch_size stays a row cap), and the
balance of a step's tokens between ranks before that.

A micro-batch's cost is the tokens its forward computes: padding-free, the sum of its rows' real tokens; padded,
rows x (longest prompt + longest completion) of the micro-batch (RolloutBatch.rows trims to those). Padded, the
rows are cut into contiguous runs of the length order (the least padding); padding-free, any rows can share a
micro-batch and they are bin-packed longest first into the least loaded (LPT). Both then balance: the largest
micro-batch is made as small as the count allows.

Moving rows between ranks changes nothing in the update: a row's loss term depends only on its own tokens,
log-probs and advantage (computed, group by group, before the rows move), and the loss is divided by the step's
normaliser over all ranks (losses.py), with the gradients summed over ranks (tests/test_packing.py: 2 ranks ==
1 process with the rows moved).
"""

from __future__ import annotations

import torch

from grpo_dist import distributed as gdist
from grpo_dist.rollout import RolloutBatch


def row_lengths(batch: RolloutBatch, rows: list[int]) -> dict[int, tuple[int, int]]:
    """{row: (prompt tokens, completion tokens)} of the real tokens (one device read)."""
    if not rows:
        return {}
    idx = torch.as_tensor(rows, dtype=torch.long, device=batch.prompt_mask.device)
    p = batch.prompt_mask[idx].sum(-1).tolist()
    c = batch.completion_mask[idx].sum(-1).tolist()
    return {r: (int(a), int(b)) for r, a, b in zip(rows, p, c)}


def padded_cost(lengths: list[tuple[int, int]]) -> int:
    """Tokens a padded forward of these rows computes."""
    return len(lengths) * (max(p for p, _ in lengths) + max(c for _, c in lengths)) if lengths else 0


def _contiguous(order: list[int], lengths: dict, limit: int, row_cap: int) -> list[list[int]]:
    """Greedy runs of `order` whose padded cost stays within limit (a row over it alone), at most row_cap rows."""
    out: list[list[int]] = []
    run: list[int] = []
    mp = mc = 0  # the run's longest prompt and completion
    for r in order:
        p, c = lengths[r]
        if run and (len(run) >= row_cap or (len(run) + 1) * (max(mp, p) + max(mc, c)) > limit):
            out.append(run)
            run, mp, mc = [], 0, 0
        run.append(r)
        mp, mc = max(mp, p), max(mc, c)
    return out + [run] if run else out


def _lpt(items: list[tuple[list[int], int]], bins: int, budget: int, row_cap: int) -> list[list[int]] | None:
    """Items (rows, tokens), longest first, into the least loaded of `bins` micro-batches with room (tokens and
    rows); None if an item finds none."""
    load = [0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    for rows, t in sorted(items, key=lambda it: (-it[1], it[0][0])):
        room = [b for b in range(bins) if len(members[b]) + len(rows) <= row_cap and
                (load[b] + t <= budget or not members[b])]
        if not room:
            return None
        b = min(room, key=lambda k: (load[k], k))
        load[b] += t
        members[b] += rows
    return [m for m in members if m]


def shared_items(lengths: dict[int, tuple[int, int]], groups: list[list[int]], budget: int,
                 row_cap: int) -> list[tuple[list[int], int]]:
    """share_prompts: the rows of each prompt group as one item costing the prompt once plus their completions; a
    group over the budget or the row cap is cut into items that fit, each paying its prompt."""
    items: list[tuple[list[int], int]] = []
    for group in groups:
        p = lengths[group[0]][0]
        rows: list[int] = []
        cost = p
        for r in sorted(group, key=lambda r: (-lengths[r][1], r)):
            if rows and (cost + lengths[r][1] > budget or len(rows) >= row_cap):
                items.append((rows, cost))
                rows, cost = [], p  # the next item pays the prompt again
            rows.append(r)
            cost += lengths[r][1]
        items.append((rows, cost))
    return items


def plan_token_budget(lengths: dict[int, tuple[int, int]], budget: int, row_cap: int, padding_free: bool,
                      at_least: int = 1, groups: list[list[int]] | None = None) -> list[list[int]]:
    """The rows of `lengths` in micro-batches of at most `budget` tokens computed and `row_cap` rows, as few as
    that allows but at least min(at_least, rows), with the largest as small as that count allows. groups (packed
    with share_prompts): rows that share a prompt, kept together where the budget allows and costed once."""
    rows = list(lengths)
    if not rows:
        return []
    if padding_free:
        items = shared_items(lengths, groups, budget, row_cap) if groups else [([r], sum(lengths[r])) for r in rows]
        total = sum(t for _, t in items)
        k = max(-(-total // budget), -(-len(rows) // row_cap), min(at_least, len(items)), 1)
        while True:  # k = len(items) always succeeds (one item each)
            plan = _lpt(items, k, budget, row_cap)
            if plan is not None:
                return [sorted(m) for m in plan]
            k += 1
    order = sorted(rows, key=lambda r: (sum(lengths[r]), r))
    k = max(len(_contiguous(order, lengths, budget, row_cap)), min(at_least, len(rows)))
    lo, hi = 1, max(budget, max(padded_cost([lengths[r]]) for r in rows))
    while lo < hi:  # the smallest largest-cost with at most k runs
        mid = (lo + hi) // 2
        if len(_contiguous(order, lengths, mid, row_cap)) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _contiguous(order, lengths, lo, row_cap)


def assign_to_ranks(tokens: list[list[int]], world_size: int) -> list[list[tuple[int, int]]]:
    """Every rank's rows (rank, row) sent to the rank with the fewest tokens so far, longest first (LPT): the same
    answer on every rank (it reads only the gathered counts)."""
    items = sorted(((t, r, i) for r, ts in enumerate(tokens) for i, t in enumerate(ts)),
                   key=lambda x: (-x[0], x[1], x[2]))
    load = [0] * world_size
    out: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for t, r, i in items:
        dst = min(range(world_size), key=lambda k: (load[k], k))
        load[dst] += t
        out[dst].append((r, i))
    return [sorted(x) for x in out]


def _units(triples: list[list[int]], share_prompts: bool) -> tuple[list[int], list[list[int]]]:
    """One rank's gathered (prompt, completion, group) per row -> the units that move between ranks together
    (share_prompts: a prompt's rows, costed with the prompt once; else each row) as (costs, rows of each)."""
    if not share_prompts:
        return [p + c for p, c, _ in triples], [[i] for i in range(len(triples))]
    by_group: dict[int, list[int]] = {}
    for i, (_, _, g) in enumerate(triples):
        by_group.setdefault(g, []).append(i)
    units = list(by_group.values())
    return [triples[u[0]][0] + sum(triples[i][1] for i in u) for u in units], units


def balance_ranks(batch: RolloutBatch, rows: list[int], advantages: torch.Tensor, pad_id: int,
                  rank: int, world_size: int, device, share_prompts: bool = False) -> tuple[RolloutBatch,
                                                                                              torch.Tensor]:
    """Collective (every rank, same order): the step's training rows redistributed so that each rank holds about
    the same number of tokens (share_prompts: a prompt's rows move together and count their prompt once).
    Returns this rank's new rows as a batch (every row trains) and their advantages."""
    lengths = row_lengths(batch, rows)
    group_of = {}
    if share_prompts and rows:
        from grpo_dist.prompt_sharing import prompt_groups
        for g, members in enumerate(prompt_groups(batch.prompt_ids, batch.prompt_mask, rows)):
            group_of.update({r: g for r in members})
    meta = torch.tensor([v for r in rows for v in (*lengths[r], group_of.get(r, 0))], dtype=torch.long,
                        device=device)
    tokens, sampler = [], []
    for r in rows:
        p, c = lengths[r]
        tokens += [batch.prompt_ids[r, batch.prompt_ids.shape[1] - p:], batch.completion_ids[r, :c]]
        if batch.sampler_logprobs is not None:
            sampler.append(batch.sampler_logprobs[r, :c])
    flat = torch.cat(tokens).to(device) if tokens else torch.zeros(0, dtype=torch.long, device=device)
    metas = gdist.all_gather_1d(meta, device)
    flats = gdist.all_gather_1d(flat, device)
    advs = gdist.all_gather_1d(advantages[rows].to(device, torch.float64) if rows else
                               torch.zeros(0, dtype=torch.float64, device=device), device)
    has_sampler = batch.sampler_logprobs is not None
    samplers = gdist.all_gather_1d(torch.cat(sampler).to(device, torch.float32) if sampler else
                                   torch.zeros(0, dtype=torch.float32, device=device), device) if has_sampler \
        else None
    triples = [m.view(-1, 3).tolist() for m in metas]
    pairs = [[(p, c) for p, c, _ in t] for t in triples]
    units = [_units(t, share_prompts) for t in triples]
    mine = sorted((r, i) for r, u in assign_to_ranks([cost for cost, _ in units], world_size)[rank]
                  for i in units[r][1][u])
    starts = [[0] for _ in pairs]  # offset of each row's tokens (and completion tokens) in its rank's stream
    cstarts = [[0] for _ in pairs]
    for r, ps in enumerate(pairs):
        for p, c in ps:
            starts[r].append(starts[r][-1] + p + c)
            cstarts[r].append(cstarts[r][-1] + c)
    P = max((pairs[r][i][0] for r, i in mine), default=1)
    C = max((pairs[r][i][1] for r, i in mine), default=1)
    n = len(mine)
    prompt_ids = torch.full((n, P), pad_id, dtype=torch.long, device=device)
    prompt_mask = torch.zeros((n, P), dtype=torch.long, device=device)
    completion_ids = torch.full((n, C), pad_id, dtype=torch.long, device=device)
    completion_mask = torch.zeros((n, C), dtype=torch.long, device=device)
    sampler_lp = torch.zeros((n, C), dtype=torch.float32, device=device) if has_sampler else None
    adv = torch.zeros(n, dtype=advantages.dtype, device=advantages.device)
    for j, (r, i) in enumerate(mine):
        p, c = pairs[r][i]
        s = starts[r][i]
        prompt_ids[j, P - p:], prompt_mask[j, P - p:] = flats[r][s:s + p], 1
        completion_ids[j, :c], completion_mask[j, :c] = flats[r][s + p:s + p + c], 1
        if samplers is not None and sampler_lp is not None:
            sampler_lp[j, :c] = samplers[r][cstarts[r][i]:cstarts[r][i] + c]
        adv[j] = advs[r][i].to(adv.dtype)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, batch.num_generations,
                        sampler_logprobs=sampler_lp), adv

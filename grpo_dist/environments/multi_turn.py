"""The multi-turn rollout driver: episodes of model turns and environment observations, on any rollout engine.

Each segment is one engine.generate call over the rows still running, with the environment's stop tokens added
to the EOS ids: a row stops at EOS (the episode is over) or at a stop marker (a tool call, in most environments).
The rows whose turn ended go to the environment together (env_response_batch); each observation is rendered,
tokenised and appended to the row as context (tool_mask 0: never trained on, never counted in the loss's token
normaliser, entropy, KL or the sampler/trainer check), and the row goes on with the next segment, prefilled from
prompt + episode so far (the KV cache is not kept across turns: the prefill is the price of letting rows wait for
a tool outside the decode batch). A row ends at EOS, when is_completed says so, after max_turns model turns, or at
the episode's token cap (max_episode_tokens, default max_completion_length: model and observation tokens together).

Segment 0 is the single-turn call itself (the unique prompts, n rows each, the rows' own sampling noise); later
segments draw from noise seeded by (the row's seed, the segment). Within a segment the engine's decode compaction
works as ever: rows that reached a stop marker leave the decode batch like rows that reached EOS.

Layout of the batch: as generate_batch (prompts left-padded and repeated, episodes right-padded), with tool_mask
[N, C] = 1 on the model's tokens and 0 on the observations', and the sampler's log-probs 0 on observation tokens.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field, replace

import torch

from grpo_dist.data.prompts import encode_prompts
from grpo_dist.rollout import RolloutBatch
from grpo_dist.rollout_engines import left_pad
from grpo_dist.sampling_noise import row_seed

SEGMENT_STREAM = 7          # sampling_noise stream of the segments after the first
MAX_SEGMENTS_PER_TURN = 8   # stop markers that did not end a turn (an opening code fence), per turn, at most
ERROR_CHARS = 300           # of an environment's exception, in the observation that reports it


@dataclass
class Episode:
    """One row's episode so far."""
    prompt: list[int]
    state: dict
    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)      # 1: the model's token, 0: an observation's
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0           # model turns that ended (at a stop marker) and got an observation
    segments: int = 0        # segments of the current turn
    done: bool = False

    def add(self, ids, logprobs, model: int) -> None:
        self.ids += ids
        self.model += [model] * len(ids)
        self.logprobs += logprobs if model else [0.0] * len(ids)


def _say_turn(ep: Episode, text: str) -> None:
    """The model's new text joins its current message (a new one after an observation)."""
    if ep.messages and ep.messages[-1]["role"] == "assistant":
        ep.messages[-1]["content"] += text
    else:
        ep.messages.append({"role": "assistant", "content": text})


def run_episodes(env, engine, tokenizer, prompts, references: list[str], sampling, max_prompt_length: int,
                 device) -> RolloutBatch:
    """Episodes of sampling.n rows per prompt, as a RolloutBatch with tool_mask (module docstring)."""
    full = encode_prompts(tokenizer, prompts)
    prompt_ids = [ids[max(0, len(ids) - max_prompt_length):] for ids in full]
    n = sampling.n
    cap = env.max_episode_tokens or sampling.max_tokens
    stops = tuple(env.stop_token_ids(tokenizer))
    eos = set(sampling.eos_ids)
    episodes = [Episode(prompt_ids[r // n], env.setup_state(
        {"prompt": prompts[r // n], "answer": references[r // n], "turn": 0, "tool_calls": 0, "tool_errors": 0,
         "tool_timeouts": 0, "tool_seconds": 0.0})) for r in range(len(prompt_ids) * n)]
    spec = replace(sampling, max_tokens=cap, eos_ids=tuple(sampling.eos_ids) + stops)
    gens = engine.generate(prompt_ids, spec)
    active, segment, row_steps = list(range(len(episodes))), 0, gens.decode_row_steps
    while True:
        pending = _take_segment(env, tokenizer, episodes, active, gens, eos, stops, cap)
        _respond(env, tokenizer, episodes, pending, cap)
        active = [r for r in active if not episodes[r].done]
        if not active:
            break
        segment += 1
        seeds = None if sampling.row_seeds is None else \
            tuple(row_seed(sampling.row_seeds[r], segment, 0, 0, SEGMENT_STREAM) for r in active)
        budget = max(cap - len(episodes[r].ids) for r in active)
        gens = engine.generate([episodes[r].prompt + episodes[r].ids for r in active],
                               replace(spec, n=1, max_tokens=budget, min_tokens=0, row_seeds=seeds))
        row_steps = None if row_steps is None or gens.decode_row_steps is None else row_steps + gens.decode_row_steps
    _count(env, episodes)
    batch = _layout(episodes, n, tokenizer, references, device)
    batch.decode_row_steps = row_steps
    batch.prompts_truncated = sum(len(ids) > max_prompt_length for ids in full)
    return batch


def _take_segment(env, tokenizer, episodes, active, gens, eos, stops, cap) -> list[int]:
    """Append each active row's new tokens; end the rows that reached EOS or the cap. Returns the rows that
    stopped at a stop marker, for the environment."""
    pending = []
    for r, ids, lps in zip(active, gens.completion_ids, gens.logprobs):
        ep = episodes[r]
        room = cap - len(ep.ids)
        ids, lps = ids[:room], lps[:room]
        ep.add(list(ids), list(lps), 1)
        _say_turn(ep, tokenizer.decode(ids, skip_special_tokens=True))
        ep.segments += 1
        last = ids[-1] if ids else None
        if last in eos:
            ep.done = True
        elif last in stops and len(ep.ids) < cap:
            pending.append(r)
        else:  # the cap (a stop marker as the very last token counts as cut too: no room for its observation)
            ep.done = True
            env.counts["cut_tokens"] += 1
    return pending


def _respond(env, tokenizer, episodes, pending: list[int], cap: int) -> None:
    """The environment's answer to every row whose turn stopped at a marker: nothing (the turn goes on), the end
    of the episode, a refusal past max_turns, or an observation appended as context."""
    ask = []
    for r in pending:
        ep = episodes[r]
        try:
            ended = env.turn_ended(ep.messages, ep.state)
            completed = ended and env.is_completed(ep.messages, ep.state)
        except Exception as e:  # noqa: BLE001 - an environment's fault ends its episode, counted, not the run
            _observe(env, tokenizer, ep, _error_text(e), cap, error=True)
            continue
        if completed:
            ep.done = True
        elif not ended:  # a stop marker inside the turn (an opening code fence): generation goes on
            if ep.segments >= MAX_SEGMENTS_PER_TURN:
                ep.done = True
                env.counts["cut_tokens"] += 1
        elif ep.turns + 1 >= env.max_turns:
            env.counts["cut_max_turns"] += 1
            env.counts["calls_after_max_turns"] += 1
            _observe(env, tokenizer, ep, f"[max_turns = {env.max_turns} reached: this tool call was not run]", cap,
                     final=True)
        else:
            ask.append(r)
    if not ask:
        return
    answers = _env_answers(env, [(episodes[r].messages, episodes[r].state) for r in ask])
    for r, (obs, err) in zip(ask, answers):
        ep = episodes[r]
        ep.turns += 1
        ep.state["turn"] = ep.turns
        if err is not None:
            _observe(env, tokenizer, ep, err, cap, error=True)
        else:
            _observe(env, tokenizer, ep, obs, cap)


def _env_answers(env, items) -> list[tuple]:
    """(observation, None) or (None, error text) per item: env_response_batch, or row by row when it raises."""
    try:
        out = env.env_response_batch(items)
        if len(out) != len(items):
            raise ValueError(f"env_response_batch returned {len(out)} answers for {len(items)} turns")
        return [(obs, None) for obs, _ in out]
    except Exception:  # noqa: BLE001 - find which rows fail
        pass
    answers: list[tuple] = []
    for messages, state in items:
        try:
            answers.append((env.env_response(messages, state)[0], None))
        except Exception as e:  # noqa: BLE001 - counted, reported to the model, the run goes on
            answers.append((None, _error_text(e)))
    return answers


def _error_text(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = f" at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno}" if where else ""
    return f"[environment error{at}: {type(e).__name__}: {e}"[:ERROR_CHARS] + "]"


def _observe(env, tokenizer, ep: Episode, obs, cap: int, error: bool = False, final: bool = False) -> None:
    """Append the rendered observation as context (tool_mask 0), cut to the episode's room; an error or a refusal
    ends the episode."""
    if error:
        env.counts["env_errors"] += 1
        final = True
        obs = [{"role": "tool", "content": obs}]
    elif isinstance(obs, str):
        obs = [{"role": "tool", "content": obs}]
    ids = tokenizer.encode(env.render_observation(obs, tokenizer), add_special_tokens=False)
    room = cap - len(ep.ids)
    if len(ids) >= room:
        env.counts["cut_tokens"] += not final
        final = True
    ids = ids[:room]
    ep.add(ids, [], 0)
    ep.messages += obs
    ep.segments = 0
    env.counts["observation_tokens"] += len(ids)
    ep.done = ep.done or final


def _count(env, episodes) -> None:
    c = env.counts
    c["episodes"] += len(episodes)
    for ep in episodes:
        c["turns"] += sum(m["role"] == "assistant" for m in ep.messages)
        for k in ("tool_calls", "tool_errors", "tool_timeouts"):
            c[k] += int(ep.state.get(k, 0))


def _layout(episodes: list[Episode], n: int, tokenizer, references, device) -> RolloutBatch:
    pad = tokenizer.pad_token_id
    ids, mask = left_pad([ep.prompt for ep in episodes[::n]], pad, "cpu")
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    width = max(1, max(len(ep.ids) for ep in episodes))
    completion_ids = torch.full((len(episodes), width), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(episodes), width), dtype=torch.long)
    tool_mask = torch.zeros((len(episodes), width), dtype=torch.long)
    logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)
    for i, ep in enumerate(episodes):
        k = len(ep.ids)
        completion_ids[i, :k] = torch.as_tensor(ep.ids, dtype=torch.long)
        completion_mask[i, :k] = 1
        tool_mask[i, :k] = torch.as_tensor(ep.model, dtype=torch.long)
        logprobs[i, :k] = torch.as_tensor(ep.logprobs, dtype=torch.float32)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    refs = [r for r in references for _ in range(n)]
    return RolloutBatch(ids, mask, completion_ids, completion_mask, n, texts, refs, logprobs,
                        tool_mask=tool_mask).to(device)

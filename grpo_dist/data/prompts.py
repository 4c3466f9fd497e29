"""Prompt text: rendering a problem with data.prompt_template (and the tokenizer's chat template) into a
RenderedPrompt that keeps the row's text apart from the template's, tokenizing it (encode_prompts: row text reaches
the model as text, never as control tokens), checking the template, and cutting pathologically long prompts before
they reach the tokenizer."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from grpo_dist.config.data_checks import template_problems
from grpo_dist.config.schema import DataConfig
from grpo_dist.data.chat_template import RenderedPrompt, chat_prompt, special_tokens, token_alternation
from grpo_dist.data.conversational import render_messages
from grpo_dist.data.examples import DataError, PromptExample


def render_prompt(example: PromptExample, cfg: DataConfig, tokenizer) -> RenderedPrompt:
    """The prompt the model is given for `example`.

    data.prompt_template must contain '{prompt}', which is replaced by the problem text. It is the only placeholder:
    every other brace is literal, so templates such as 'Put the answer in \\boxed{}. {prompt}' need no doubled braces.
    With data.use_chat_template the filled template is the user message (after data.system_prompt, if set) and the
    tokenizer's chat template renders it with the generation prompt appended. Either way the problem text stays
    text (RenderedPrompt); a prompt whose problem spells no special token tokenizes exactly like its text.
    """
    if example.messages is not None:  # TRL's conversational format: the row's own messages
        return render_messages(example, cfg, tokenizer)
    bad = template_problems(cfg.prompt_template)
    if bad:
        raise DataError(bad[0])
    if not cfg.use_chat_template:
        parts = cfg.prompt_template.split("{prompt}")
        pieces = [(parts[0], False)]
        for part in parts[1:]:
            pieces += [(example.prompt, True), (part, False)]
        return RenderedPrompt(tuple((t, lit) for t, lit in pieces if t))
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("config key 'data.use_chat_template' is true but the tokenizer has no chat_template; set "
                        "data.use_chat_template=false or use a tokenizer with one")

    def messages(rows: list[str]) -> list[dict]:
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return system + [{"role": "user", "content": cfg.prompt_template.replace("{prompt}", rows[0])}]
    return chat_prompt(tokenizer, messages, [example.prompt], [cfg.prompt_template, cfg.system_prompt or ""],
                       example.index)


def encode_prompts(tokenizer, prompts: Sequence[str | RenderedPrompt]) -> list[list[int]]:
    """Token ids of each prompt, no special tokens added, not truncated.

    A str is the caller's own full text: tokenized as is, special tokens parsed. So is a RenderedPrompt whose
    literal pieces spell no special token: its ids are exactly tokenizer(prompt.text)'s, normal data tokenizes as
    it always did. Otherwise the special tokens of its other pieces become their ids, and all text between them,
    literal pieces included, is tokenized with split_special_tokens=True: a literal '<|im_end|>' is ordinary tokens
    that decode back to '<|im_end|>'.
    """
    specials = special_tokens(tokenizer)
    pattern = token_alternation(tuple(specials))
    out: list[list[int] | None] = [None] * len(prompts)
    plain: list[tuple[int, str]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            plain.append((i, p))
        elif pattern is None or not any(lit and pattern.search(t) for t, lit in p.pieces):
            plain.append((i, p.text))
        else:
            out[i] = _encode_pieces(tokenizer, p, pattern, specials)
    if plain:
        encoded = tokenizer([t for _, t in plain], add_special_tokens=False)["input_ids"]
        for (i, _), ids in zip(plain, encoded):
            out[i] = list(ids)
    return [ids if ids is not None else [] for ids in out]


def _encode_pieces(tokenizer, prompt: RenderedPrompt, pattern: re.Pattern,
                   specials: dict[str, tuple[int, bool, bool]]) -> list[int]:
    ids: list[int] = []
    text: list[str] = []  # ordinary text since the last special token
    strip_next = False  # the last special token takes the whitespace after it (rstrip), as the tokenizer does

    def add_text(t: str) -> None:
        nonlocal strip_next
        if strip_next:
            t = t.lstrip()
            strip_next = not t
        text.append(t)

    def flush() -> None:
        if "".join(text):
            ids.extend(tokenizer("".join(text), add_special_tokens=False, split_special_tokens=True)["input_ids"])
        text.clear()

    for piece, literal in prompt.pieces:
        if literal:
            add_text(piece)
            continue
        pos = 0
        for m in pattern.finditer(piece):
            add_text(piece[pos:m.start()])
            token_id, lstrip, rstrip = specials[m.group(0)]
            if lstrip:  # it takes the whitespace before it
                joined = "".join(text).rstrip()
                text[:] = [joined]
            flush()
            ids.append(token_id)
            strip_next, pos = rstrip, m.end()
        add_text(piece[pos:])
    flush()
    return ids


# Characters kept per token of max_prompt_length when a prompt is cut before tokenizing: generous (most tokens
# are 3-5 characters, whitespace runs of code tokenizers up to ~16), so the left truncation to max_prompt_length
# tokens still happens on real tokens, but a 10 MB row never reaches the tokenizer whole (GBs, seconds per step).
CHARS_PER_TOKEN_BOUND = 16


def truncate_long_prompts(examples: list[PromptExample], max_prompt_length: int, where: str,
                          warn: bool = True) -> list[PromptExample]:
    """Keep the last max_prompt_length * CHARS_PER_TOKEN_BOUND characters of over-long prompts (prompts are
    truncated from the left, like the tokens later); one warning per file with the count."""
    limit = max_prompt_length * CHARS_PER_TOKEN_BOUND
    cut = [i for i, e in enumerate(examples) if len(e.prompt) > limit]
    if not cut:
        return examples
    out = list(examples)
    longest = max(len(examples[i].prompt) for i in cut)
    for i in cut:
        out[i] = dataclasses.replace(out[i], prompt=out[i].prompt[-limit:])
    if not warn:
        return out
    print(f"[grpo_dist] warning: {where}: {len(cut)} of {len(examples)} prompts are longer than {limit} characters "
          f"(up to {longest}); kept their last {limit} characters before tokenizing (max_prompt_length="
          f"{max_prompt_length} tokens, truncated from the left)", flush=True)
    return out


# prompts the start check tokenizes at most (an evenly spaced sample above it: the fraction is then an estimate,
# within ~0.3 points at 5 % for 20000)
PROMPT_CHECK_LIMIT = 20000


def prompt_length_check(examples: list[PromptExample], data_cfg, tokenizer) -> tuple[str | None, str | None]:
    """(warning, error): how many training prompts are longer than data.max_prompt_length tokens once rendered,
    so that the rollouts keep only their last max_prompt_length tokens (their beginning is lost, their reference
    answer stays). error when that fraction is above data.max_truncated_prompt_fraction, else a warning when any is
    cut; (None, None) when none is."""
    limit = data_cfg.max_prompt_length
    step = max(1, -(-len(examples) // PROMPT_CHECK_LIMIT))
    checked = examples[::step]
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [render_prompt(e, data_cfg, tokenizer)
                                                             for e in checked])]
    cut = sum(n > limit for n in lengths)
    if not cut:
        return None, None
    frac, allowed = cut / len(checked), data_cfg.max_truncated_prompt_fraction
    of = f"{cut} of {len(checked)} training prompts" + (f" (every {step}th of {len(examples)})" if step > 1 else "")
    what = (f"{of} ({frac:.1%}) are longer than data.max_prompt_length={limit} tokens once rendered (the longest "
            f"{max(lengths)}): they lose their beginning, cut from the left, while their reference answer stays")
    if frac > allowed:
        return None, (f"{what}; that is more than data.max_truncated_prompt_fraction={allowed:g}: raise "
                      f"data.max_prompt_length (to {max(lengths)} to keep every prompt whole), shorten the prompt "
                      f"template, or raise data.max_truncated_prompt_fraction")
    return f"warning: {what}; counted per step as prompts_truncated", None

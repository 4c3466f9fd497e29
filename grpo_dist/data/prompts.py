"""Prompt text: rendering a problem with data.prompt_template (and the tokenizer's chat template), checking the
template, and cutting pathologically long prompts before they reach the tokenizer."""

from __future__ import annotations

import dataclasses

from grpo_dist.config import DataConfig
from grpo_dist.data.examples import DataError, PromptExample


def template_problems(template) -> list[str]:
    """The problem of a data.prompt_template without its one placeholder, '{prompt}' (none when it has it)."""
    if not isinstance(template, str) or "{prompt}" not in template:
        return [f"config key 'data.prompt_template' must contain '{{prompt}}', got {template!r}"]
    return []


def render_prompt(example: PromptExample, cfg: DataConfig, tokenizer) -> str:
    """The text the model is prompted with.

    data.prompt_template must contain '{prompt}', which is replaced by the problem text. It is the only placeholder:
    every other brace is literal, so templates such as 'Put the answer in \\boxed{}. {prompt}' need no doubled braces.
    With data.use_chat_template the filled template is the user message (after data.system_prompt, if set) and the
    tokenizer's chat template renders it with the generation prompt appended.
    """
    if example.messages is not None:  # TRL's conversational format: the row's own messages
        from grpo_dist.data.conversational import render_messages
        return render_messages(example, cfg, tokenizer)
    bad = template_problems(cfg.prompt_template)
    if bad:
        raise DataError(bad[0])
    user = cfg.prompt_template.replace("{prompt}", example.prompt)
    if not cfg.use_chat_template:
        return user
    messages = []
    if cfg.system_prompt:
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": user})
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("config key 'data.use_chat_template' is true but the tokenizer has no chat_template; set "
                        "data.use_chat_template=false or use a tokenizer with one")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):  # some versions wrap single conversations
        text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
    return text


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

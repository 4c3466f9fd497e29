"""Prompts in TRL's conversational format: a row whose prompt field is a list of {"role", "content"} messages
(e.g. [{"role": "system", ...}, {"role": "user", ...}]) is rendered with the tokenizer's chat template and the
generation prompt, whatever data.use_chat_template says; no template string is needed. data.system_prompt, when set,
becomes the first message of rows that have no system message; data.prompt_template is for text prompts only and is
refused here rather than ignored."""

from __future__ import annotations

from grpo_dist.config.schema import DataConfig
from grpo_dist.data.examples import DataError, PromptExample
from grpo_dist.data.chat_template import RenderedPrompt, chat_prompt

_DEFAULT_TEMPLATE = "{prompt}"


def conversation_problems(examples: list[PromptExample], cfg: DataConfig) -> list[str]:
    """Settings that cannot apply to the chat-message rows among `examples` (checked when the data is loaded)."""
    chats = [e for e in examples if e.messages is not None]
    if not chats:
        return []
    bad = []
    if cfg.prompt_template != _DEFAULT_TEMPLATE:
        bad.append(f"config key 'data.prompt_template' = {cfg.prompt_template!r} applies to text prompts, but row "
                   f"{chats[0].index + 1} of the data holds chat messages (rendered with the tokenizer's chat "
                   f"template): remove data.prompt_template")
    own = next((e for e in chats if any(m["role"] == "system" for m in e.messages or [])), None)
    if cfg.system_prompt and own is not None:
        bad.append(f"config key 'data.system_prompt' is set, but row {own.index + 1} of the data has its own "
                   f"system message: remove one of them")
    return bad


def render_messages(example: PromptExample, cfg: DataConfig, tokenizer) -> RenderedPrompt:
    """The row's messages through the chat template; every message's content is row text, so it reaches the model
    as text even where it spells a special token (prompts.chat_prompt)."""
    bad = conversation_problems([example], cfg)
    if bad:
        raise DataError(bad[0])
    own = list(example.messages or [])
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"row {example.index + 1} of the data holds chat messages (TRL's conversational format), "
                        f"which need a tokenizer with a chat_template; this tokenizer has none (model.tokenizer)")

    def messages(rows: list[str]) -> list[dict]:
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return system + [dict(m, content=r) for m, r in zip(own, rows)]
    return chat_prompt(tokenizer, messages, [str(m["content"]) for m in own], [cfg.system_prompt or ""],
                       example.index)

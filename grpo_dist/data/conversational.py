"""Prompts in TRL's conversational format: a row whose prompt field is a list of {"role", "content"} messages
(e.g. [{"role": "system", ...}, {"role": "user", ...}]) is rendered with the tokenizer's chat template and the
generation prompt, whatever data.use_chat_template says; no template string is needed. data.system_prompt, when set,
becomes the first message of rows that have no system message; data.prompt_template is for text prompts only and is
refused here rather than ignored."""

from __future__ import annotations

from grpo_dist.config import DataConfig
from grpo_dist.data.examples import DataError, PromptExample

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


def render_messages(example: PromptExample, cfg: DataConfig, tokenizer) -> str:
    bad = conversation_problems([example], cfg)
    if bad:
        raise DataError(bad[0])
    messages = list(example.messages or [])
    if cfg.system_prompt:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"row {example.index + 1} of the data holds chat messages (TRL's conversational format), "
                        f"which need a tokenizer with a chat_template; this tokenizer has none (model.tokenizer)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):  # some versions wrap single conversations
        text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
    return text

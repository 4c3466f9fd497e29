"""The chat template applied with the row's text kept as text: RenderedPrompt (a prompt cut into template text and
row text) and chat_prompt, which renders messages through the tokenizer's chat template and marks where the row's
own text landed, so that a row spelling a special token still reaches the model as ordinary tokens. prompts.py
(plain rows) and conversational.py (TRL's message rows) both render through it."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from grpo_dist.config.errors import short
from grpo_dist.data.examples import DataError


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as the model gets it, cut into pieces of text. A `literal` piece is row text (the problem of a data
    row) and reaches the model as ordinary tokens even where it spells a special token: a question holding
    '<|im_end|>\\n<|im_start|>assistant\\n' must not close the user turn and open a fake assistant one. The rest
    (the chat template, data.prompt_template, data.system_prompt: the config's own text) is tokenized as usual,
    special tokens parsed. `text` is the whole prompt, for logs and display; encode_prompts gives its token ids."""

    pieces: tuple[tuple[str, bool], ...]  # (text, literal)

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)


def chat_prompt(tokenizer, messages, rows: list[str], config_texts: list[str], index: int,
                generation_prompt: bool = True) -> RenderedPrompt:
    """The chat template rendered over messages(rows) (with the generation prompt unless generation_prompt is
    false: a finished conversation, as a reward model reads it), the row texts `rows` kept as text. The chat
    template is a program over the message text (some trim it, some split it): it renders the rows with every
    special-token string replaced by a numbered marker of private-use characters, and the marked spots become the
    literal pieces. Rows without such strings render exactly as themselves."""
    pattern = special_pattern(tokenizer)
    if pattern is None or not any(pattern.search(r) for r in rows):
        return RenderedPrompt(((_chat_text(tokenizer, messages(rows), generation_prompt), False),))
    markers = _markers(rows + config_texts + [str(getattr(tokenizer, "chat_template", ""))])
    spelled: list[str] = []

    def mark(m: re.Match) -> str:
        spelled.append(m.group(0))
        return f"{markers[0]}{len(spelled) - 1}{markers[1]}"
    text = _chat_text(tokenizer, messages([pattern.sub(mark, r) for r in rows]), generation_prompt)
    pieces, pos = [], 0
    for m in re.finditer(f"{markers[0]}(\\d+){markers[1]}", text):
        if int(m.group(1)) >= len(spelled):
            break  # not a marker of ours: the check below refuses the row
        pieces += [(text[pos:m.start()], False), (spelled[int(m.group(1))], True)]
        pos = m.end()
    pieces.append((text[pos:], False))
    rendered = RenderedPrompt(tuple((t, lit) for t, lit in pieces if t))
    if markers[0] in rendered.text or markers[1] in rendered.text:  # the template cut or rewrote a marker
        raise DataError(f"the problem of example {index} (0-based, in its split) spells a special token "
                        f"({short(spelled[0])}) and the tokenizer's chat template alters the row's text, so it "
                        f"cannot be kept as text: remove the special-token strings from the row")
    return rendered


def _chat_text(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):  # some versions wrap single conversations
        text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
    return text


# Marker characters (Unicode private use area) for render_prompt: the first pair that occurs in none of the texts
_MARKER_PAIRS = [("\ue000", "\ue001"), ("\uf8fe", "\uf8ff"), ("\U000f0000", "\U000f0001"),
                 ("\U0010fffc", "\U0010fffd")]


def _markers(texts: list[str]) -> tuple[str, str]:
    for pair in _MARKER_PAIRS:
        if not any(c in t for c in pair for t in texts):
            return pair
    raise DataError("a data row, the prompt template and the chat template use every private-use marker "
                    "character grpo_dist keeps row text apart with; remove them from the row")


def special_tokens(tokenizer) -> dict[str, tuple[int, bool, bool]]:
    """{text: (id, lstrip, rstrip)} of the tokenizer's special added tokens: the strings that tokenizing text turns
    into control tokens, and that split_special_tokens=True leaves as text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: (i, bool(t.lstrip), bool(t.rstrip)) for i, t in decoder.items()
            if getattr(t, "special", False) and t.content}


def special_pattern(tokenizer) -> re.Pattern | None:
    return token_alternation(tuple(special_tokens(tokenizer)))


@functools.lru_cache(maxsize=16)
def token_alternation(strings: tuple[str, ...]) -> re.Pattern | None:
    """Leftmost-longest match of any of `strings`, as the tokenizer's added-token matcher finds them."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True)))

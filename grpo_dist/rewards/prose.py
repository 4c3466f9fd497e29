"""The answer of a completion that ends in a plain sentence, with no box and no final-answer marker: the
concluding sentence of worked text (rule 3b, below) or a completion that is one short statement (rule 3c,
``lone_statement_answer``).

Rule 3b of grpo_dist.rewards.math (docs/grading.md, "Answers in prose"): the *final sentence* of the completion
states its answer, the way a person reads a worked solution that ends "Therefore, the probability that Alice wins
is 2/3.".  Every part of the rule says what it refuses, because paying "the last number of the text" pays hedges
and truncated work:

- The completion ends at its first end-of-turn token (``<|im_end|>``, ``<|im_start|>``, ``<|endoftext|>``, ...):
  what follows is a turn the model invented, not its answer.  Closing courtesies that state nothing ("I hope it
  is correct.", "Hope this helps!") are dropped from the end.
- The final sentence must be complete: it ends with a full stop or "!", or the whole completion is one short line
  (at most BARE_MAX_CHARS).  A long text that stops mid-sentence was cut by the token limit and its last number is
  work in progress.
- A sentence that hedges is no answer: "or", "maybe", "perhaps", "possibly", "probably", "either", "might",
  "could", "approximately"... or a question mark ("it is 5, or maybe 7").
- The answer is the *last* value of the sentence (a number, a percent, or a ``$...$`` segment with a digit in
  it), as for an equality chain: "the number is 10 which is 1,000.99" states 1000.99.  A value right after "not"
  is denied and skipped ("the answer is 5, not 6" is 5); words after the answer that deny it ("..., which is
  wrong") refuse the sentence.
- Values joined to the last one by list words only ("2 and 3", "2, 3") are one list answer, so "the roots are 2
  and 3" is never paid for the reference 3 alone.
"""
from __future__ import annotations

import re

from .answer_words import BARE_MAX_CHARS, UNIT_WORDS, denied

# Tokens that end a chat turn in the common templates (ChatML, Llama 3, Gemma, SentencePiece EOS).
_END_OF_TURN_RE = re.compile(r"<\|im_end\|>|<\|im_start\|>|<\|endoftext\|>|<\|eot_id\|>|<\|end\|>|"
                             r"<\|start_header_id\|>|<end_of_turn>|<start_of_turn>|</s>")
_COURTESY_RE = re.compile(r"(?i)\s*(?:i\s+hope\s+(?:it|this|that)\s+is\s+(?:correct|right|helpful)|"
                          r"(?:i\s+)?hope\s+(?:this|it|that)\s+helps)\s*[.!]*\s*$")
_HEDGE_RE = re.compile(r"(?i)\b(?:or|maybe|perhaps|possibly|probably|either|might|could|approximately|roughly|"
                       r"about|around|guess|unsure|not\s+sure|likely|alternatively)\b|\?")
# A value: a $...$ segment (``\$`` is a currency sign, not a delimiter), or a number -- thousands separators,
# decimal point or comma, a fraction a/b, a percent -- not glued to a letter or an exponent before it (m^2).
_VALUE_RE = re.compile(r"(?<!\\)\$(?P<seg>(?:\\\$|[^$])+?)(?<!\\)\$|"
                       r"(?<![\w^{.,/\\])(?P<num>-?\d+(?:,\d{3})*(?:[.,]\d+)?(?:/\d+)?(?:\s*%)?)(?![\d/])")
_LIST_GAP_RE = re.compile(r"(?i)\s*(?:,|;|&|\band\b|\s)+\s*")
_NOT_BEFORE_RE = re.compile(r"(?i)\b(?:not|isn't|isnt|never)\s*(?:equal\s+to\s+|be\s+)?$")
# The words that open the conclusion of a worked solution.
_CONCLUSION_RE = re.compile(r"(?i)(?:therefore|thus|hence|so|in\s+conclusion|in\s+summary|finally|consequently)\b")
# ... capitalised, they open a new sentence even with no full stop before ("... P(A) = 2/3 Therefore, ...").
_OPENS_RE = re.compile(r"(?:Therefore|Thus|Hence|So|In conclusion|In summary|Finally|Consequently)\b")
# A sentence ends at . ! ? followed by a space and not inside a number (1,000.99) or a $...$ segment.
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s)")


def end_of_turn(text: str) -> str:
    """The completion up to its first end-of-turn token."""
    m = _END_OF_TURN_RE.search(text)
    return text[:m.start()] if m else text


def _final_sentence(text: str) -> str | None:
    t = _COURTESY_RE.sub("", end_of_turn(text)).strip()
    if not t:
        return None
    if not t.endswith((".", "!")) and (len(t) > BARE_MAX_CHARS or "\n" in t):
        return None  # cut off mid-sentence: work in progress
    t = t.rstrip(".! ")
    start = 0
    in_math = False
    for i, c in enumerate(t):  # the last sentence end outside $...$
        if c == "$" and (i == 0 or t[i - 1] != "\\"):
            in_math = not in_math
        elif not in_math and (c == "\n" or _SENTENCE_END_RE.match(t, i) is not None
                              or (c == " " and _OPENS_RE.match(t, i + 1) is not None)):
            start = i + 1
    if start == 0:
        return None  # a lone sentence is not a conclusion: prose with no marker is no answer (rule 3)
    s = t[start:].strip()
    return s if _CONCLUSION_RE.match(s) else None


def final_sentence_answer(text: str) -> str | None:
    """The answer stated by the final sentence of a completion (see the module docstring), or None."""
    s = _final_sentence(text)
    if s is None or _HEDGE_RE.search(s):
        return None
    values = []
    for m in _VALUE_RE.finditer(s):
        body = m.group("seg") if m.group("seg") is not None else m.group("num")
        if m.group("seg") is not None and not re.search(r"\d", body):
            continue  # "$(x, y)$" names what is asked; it is words here
        if _NOT_BEFORE_RE.search(s[:m.start()]):
            continue  # "not 10": denied
        values.append((m.start(), m.end(), body.strip()))
    if not values:
        return None
    last = values[-1]
    if denied(s[last[1]:]):
        return None
    run = [last]
    for prev in reversed(values[:-1]):
        if not _LIST_GAP_RE.fullmatch(s[prev[1]:run[0][0]]):
            break
        run.insert(0, prev)
    return ", ".join(v for _, _, v in run)


# Rule 3c: a completion that is one short statement.  Words that deny something somewhere in the statement
# (not only right before a value) make it ambiguous: "5 is not the answer", "not it's 7".
_NEGATION_RE = re.compile(r"(?i)\b(?:not|no|never|none|nor|neither|cannot|wrong|incorrect|false|except|unless|"
                          r"instead|rather)\b|n't\b|\bisnt\b")
# A number written in words is a second candidate value ("it is 5 and seven").
_NUMBER_WORD_RE = re.compile(r"(?i)\b(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|"
                             r"thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|"
                             r"forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand|million|billion|half|"
                             r"third|quarter|twice|double|triple)\b")
# The value must be asserted: the words right before it say it is the value ("is 5", "= 5", ": 5", "it's 5"),
# a currency sign allowed in between ("is $5", "is \$5", "is €5").
_ASSERTS_RE = re.compile(r"(?i)(?:\b(?:is|are|was|were|equals?|be|gives?|get|got|makes?|comes\s+to)|'s|=|:)"
                         r"\s*(?:\\?\$|€|£)?\s*$")

# Math that goes on after the number: "10^6", "3x", "2 + 3", "5 squared" are not the value 10, 3, 2 or 5. A unit
# glued to it is no math ("1,000.99m^{2}", "12cm").
_MORE_MATH_RE = re.compile(rf"(?i)\s*[\^*+\-=\\(_×·]|(?!(?:{UNIT_WORDS})(?![A-Za-z]))[A-Za-z]|"
                           r"\s+(?:squared|cubed|factorial|to\s+the|over|divided|plus|minus|times)\b")


def hedged(words: str) -> bool:
    """True when a sentence hedges, names a number in words or denies something: it states no one value."""
    return bool(_HEDGE_RE.search(words) or _NUMBER_WORD_RE.search(words) or _NEGATION_RE.search(words))


def lone_statement_answer(text: str) -> str | None:
    """The value of a completion that is one short statement asserting exactly one value (rule 3c), or None.

    "the answer is 42", "We computed it and it is 5.", "Soucis : 2,74 $": one line of at most BARE_MAX_CHARS
    characters, one sentence, no box.  Refused: a hedge word or "?", a second candidate value (a value denied
    by a "not" right before it does not count: "the number is not 10 which is 1,000.99" is 1000.99), a
    number in words, any other negation ("5 is not it"), words after the value that deny it, and a value that
    nothing asserts ("Step 1: add the terms.")."""
    if len(text) > 2 * BARE_MAX_CHARS and len(text.strip()) > 2 * BARE_MAX_CHARS:
        return None  # far too long for one short statement, whatever courtesy or turn ends it (cheap on 1 MB)
    t = _COURTESY_RE.sub("", end_of_turn(text)).strip().rstrip(".! ")
    if (not t or len(t) > BARE_MAX_CHARS or "\n" in t or "\\boxed" in t or "\\fbox" in t
            or _HEDGE_RE.search(t) or _NUMBER_WORD_RE.search(t) or _has_sentence_end(t)):
        return None
    values, denials = [], 0
    for m in _VALUE_RE.finditer(t):
        body = m.group("seg") if m.group("seg") is not None else m.group("num")
        if m.group("seg") is not None and not re.search(r"\d", body):
            continue  # "$f(x)$" names what is asked: words
        if _NOT_BEFORE_RE.search(t[:m.start()]):
            denials += 1  # "not 10": denied, not a candidate
            continue
        values.append(m)
    if len(values) != 1 or len(_NEGATION_RE.findall(t)) != denials:
        return None
    m = values[0]
    if not _ASSERTS_RE.search(t[:m.start()]) or denied(t[m.end():]) or _MORE_MATH_RE.match(t, m.end()):
        return None
    return (m.group("seg") if m.group("seg") is not None else m.group("num")).strip()


def _has_sentence_end(t: str) -> bool:
    """A sentence end outside $...$ before the end of t: more than one sentence."""
    in_math = False
    for i, c in enumerate(t):
        if c == "$" and (i == 0 or t[i - 1] != "\\"):
            in_math = not in_math
        elif not in_math and _SENTENCE_END_RE.match(t, i) is not None:
            return True
    return False

"""Finding the final answer in a completion or a reference: boxes, final-answer phrases, '#### n' lines and bare
answers (rules 1-3 of :mod:`grpo_dist.rewards.math`). Pure string work, without sympy, so the data loader reads
references with it and a trainer process never imports the grader.

``last_boxed(text)``: the content of the last box. ``answer_parts(text)``: the final answer as a list of strings
(several for a group of boxes; ``extract_answer`` in :mod:`grpo_dist.rewards.math` merges equivalent ones);
``answer_group(text)`` also says whether the parts are ordered (boxes labelled as the parts of a question).
"""
from __future__ import annotations

import re

from .answer_words import BARE_MAX_CHARS, UNIT_WORDS, denied
from .prose import final_sentence_answer, hedged, lone_statement_answer

MAX_ANSWER_CHARS = 2000    # longest answer (after extraction) the grader tries to parse
_BOX_NAMES = ("\\boxed", "\\fbox")
MAX_BOXES = 8              # boxes looked at (the last ones); more are never an answer group
MAX_GAP_CHARS = 80         # longest text between two boxes of one answer group
_BRACE_TOK_RE = re.compile(r"\\.|[{}]", re.S)
MATH_WORDS = {"sqrt", "pi", "sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp",
              "infty", "infinity", "inf", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh"}


def _brace_span(text: str, start: int, limit: int):
    """(content, end) of the brace group at text[start] == '{'; (None, None) if unclosed.

    Only the next ``limit`` characters are scanned: a longer group is returned
    truncated to limit + 1 characters (too long for is_equivalent, so it grades 0).
    """
    depth = 0
    stop = min(len(text), start + limit + 2)
    for m in _BRACE_TOK_RE.finditer(text, start, stop):
        c = m.group(0)
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:m.start()], m.end()
    if stop < len(text):
        return text[start + 1:stop], stop
    return None, None


def reference_boxes(text: str) -> list:
    """The answer boxes of a reference: the last box group, where a gap may also name what the value before it
    counts (``\\boxed{1} papers and \\boxed{2} bins``: a joining word and at most two other words) or be symbols
    only (``\\boxed{35} ++++++ \\boxed{4}``: no letter, digit or command, at most 40 characters)."""
    spans = _box_spans(text)
    if not spans:
        return []
    group = [spans[-1]]
    for prev in reversed(spans[:-1]):
        gap = text[prev[1]:group[0][0]]
        words = re.findall(r"[A-Za-z]+", gap)
        joined = any(w.lower() in ("and", "or") for w in words) or "," in gap or ";" in gap
        symbols_only = re.fullmatch(r"[^\w\\]{1,40}", gap) is not None  # "\boxed{35} ++++++ \boxed{4}"
        if not (_connective(gap) or symbols_only or (joined and len(words) <= 3 and len(gap) <= 40)):
            break
        group.insert(0, prev)
    return [c for _, _, c in group]


def last_boxed(text: str):
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces), or of `\\boxed 5`; None if absent."""
    spans = _box_spans(text)
    return spans[-1][2] if spans else None


def _box_spans(text: str) -> list:
    """(start, end, content) of the last MAX_BOXES outermost boxes, in text order."""
    starts = set()
    for name in _BOX_NAMES:
        end = len(text)
        for _ in range(2 * MAX_BOXES):
            p = text.rfind(name, 0, end)
            if p < 0:
                break
            starts.add((p, name))
            end = p
    spans = []
    for p, name in sorted(starts)[-2 * MAX_BOXES:]:
        j = p + len(name)
        if j < len(text) and text[j].isalpha():  # \boxedfoo is another macro
            continue
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            content, stop = _brace_span(text, j, 2 * MAX_ANSWER_CHARS)
            if content is None:
                continue
            spans.append((p, stop, content))
        elif j > p + len(name):  # "\boxed 5"
            m = re.match(r"[^\s$]+", text[j:j + 200])
            if m:
                spans.append((p, j + m.end(), m.group(0)))
    outer = [s for s in spans if not any(o[0] < s[0] and s[1] <= o[1] for o in spans)]
    return outer[-MAX_BOXES:]


_GAP_WRAP_RE = re.compile(r"\\(?:text|textnormal|textrm|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
# the label of a question's part: "for part (a)", "part 2", "(b)" (not "f(a)")
_PART_LABEL_RE = re.compile(r"(?i)\b(?:for\s+)?(?:the\s+)?part\s*\(?[a-z0-9]{1,3}\)?|(?<![A-Za-z])\([a-h]\)")
_GAP_NOISE_RE = re.compile(
    r"\\(?:quad|qquad|lor|vee|[,;:!\\ ()\[\]])|"
    r"(?:[A-Za-z]{1,3}(?:_\{?\w{1,3}\}?)?|\([a-z]\))\s*(?:=|:)|\([a-z]\)"
)
# words that join boxes into one answer (a list, or a hedge between alternatives)
_GAP_WORDS = {"and", "or", "maybe", "possibly", "perhaps", "alternatively", "either", "also",
              "otherwise", "nor", "both", "plus", "as", "well", "else", "respectively"}


def _connective(gap: str) -> bool:
    """True when two boxes are joined only by punctuation, labels or and/or-like words."""
    if len(gap) > MAX_GAP_CHARS:
        return False
    g = _GAP_WRAP_RE.sub(r" \1 ", gap)
    g = _GAP_NOISE_RE.sub(" ", g)
    words = re.findall(r"[A-Za-z]+", g)
    if any(w.lower() not in _GAP_WORDS for w in words):
        return False
    return re.fullmatch(r"[\sA-Za-z,;.:$&()*/\-]*", g) is not None


def _box_group(text: str, spans: list) -> tuple[list, bool]:
    """Contents of the final answer group (the last box and the boxes chained to it), and whether they are
    the labelled parts of a question ("(a) ... (b) ...", "for part (a) and ..."): then their order counts."""
    group = [spans[-1]]
    parts = False
    for prev in reversed(spans[:-1]):
        gap = text[prev[1]:group[0][0]]
        labelled = _PART_LABEL_RE.search(gap) is not None
        if not _connective(_PART_LABEL_RE.sub(" ", gap) if labelled else gap):
            break
        parts = parts or labelled
        group.insert(0, prev)
    return [c.strip() for _, _, c in group], parts and len(group) > 1


_PHRASE_RE = re.compile(
    r"(?:final\s+answer[\s*_]*(?:is\b|:|=|\n)|\banswer[\s*_]*(?:is\s*)?:|"
    r"(?<![^\n])[*_]*Answer[*_]*[ \t]*(?=\$\$|\\\[))[\s*_]*:?\s*", re.I)  # a line "Answer \[ 9 \]"
_LEAD_RE = re.compile(
    r"(?i)(?:the|so|thus|hence|therefore|it|this|that|our|we|a|an|my)\b[^=]{0,80}?\s"
    r"(?:is|are|equals|was|be|gives|get)\s*:?\s+(?=\S)"
)
_FILLER_RE = re.compile(r"(?i)^(?:therefore|thus|then|clearly|simply|just|exactly|equal\s+to|given\s+by)\s+")
_TAIL_WORDS_RE = re.compile(
    r"(?i)[\s,]+(?:because|since|as|which|where|when|so|for|if|but|i\s+hope|hence|thus|after)\b.*$"
)


def _leading_segment(line: str):
    """``$5$.`` / ``$5$. I hope it is correct.`` -> ``5``; None when more math follows (``$4$ or $5$``)."""
    if not line.startswith("$"):
        return None
    body = line.lstrip("$")
    q = body.find("$")
    if q < 0:
        return None
    after = body[q:].lstrip("$").strip()
    if after and after[0] not in ".!;":
        return None
    return body[:q].strip() or None


_QUOTED_RE = re.compile(r'^\\?"([^"]*?)\\?"')


_DISPLAY_RE = re.compile(r"\s*(?:\$\$(.{1,400}?)\$\$|\\\[(.{1,400}?)\\\])", re.S)


def _phrase_answer(rest: str):
    """The answer stated right after a final-answer phrase (its first non-empty line, or the display math that
    starts there, over several lines)."""
    m = _DISPLAY_RE.match(rest)
    if m and "\n" in m.group(0):
        return (m.group(1) or m.group(2) or "").strip() or None
    lines = [ln.strip(" \t*_#>") for ln in rest.split("\n", 3)[:3]]
    line = next((ln for ln in lines if ln), "")
    if not line:
        return None
    seg = _leading_segment(line)
    if seg is not None:
        return seg
    line = _LEAD_RE.sub("", line, count=1) if _LEAD_RE.match(line) else line
    line = _QUOTED_RE.sub(r"\1", line)  # the final answer is "$12$ and $13$". I hope...
    seg = _leading_segment(line)
    if seg is not None:
        return seg
    m = re.match(r"(.*?)(?:\.\s|\.$|$)", line)
    ans = m.group(1).strip() if m else line
    ans = _FILLER_RE.sub("", ans)
    ans = _TAIL_WORDS_RE.sub("", ans)
    return ans.strip("$ ") or None


def _gradeable(ans: str) -> bool:
    """A phrase answer that may override an earlier box: math or a choice, not prose."""
    if re.fullmatch(r"\(?[A-Z]\)?", ans):
        return True
    return bool(re.search(r"[\d\\]", ans)) and not _has_prose(ans)


MAX_PHRASES = 16           # final-answer phrases looked at (the last ones)


def _phrase_matches(text: str, start: int) -> list:
    """The last MAX_PHRASES final-answer phrases after ``start`` (found via "answer", in C)."""
    low = text.lower()
    out = []
    end = len(text)
    for _ in range(MAX_PHRASES):
        p = low.rfind("answer", start, end)
        if p < 0:
            break
        end = p
        m = _PHRASE_RE.search(text, max(start, p - 24), min(len(text), p + 48))
        if m and m.start() <= p < m.end():
            out.append(m)
    return out


def answer_parts(text: str):
    """The final answer of a completion as a list of strings (several for a box group)."""
    return answer_group(text)[0]


def split_top_level(s: str) -> list:
    """``(2,2), (0,1)`` -> ``["(2,2)", "(0,1)"]``: the items of a list split at commas and semicolons outside
    brackets."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c in ",;" and depth == 0 and s[max(0, i - 1):i] != "\\":
            out.append(s[start:i].strip())
            start = i + 1
    out.append(s[start:].strip())
    return [x for x in out if x]


_PERCENT_AFTER_RE = re.compile(r"(?i)\d\s*(?:%|per\s*cent|pct)")
_NUMBER_RE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:/\d+)?(?![\w.])")


def _number_in_words(ans: str):
    """A final-answer sentence in words with exactly one number in it ("Jane started 3 hours ago") -> "3"."""
    ans = re.sub(r"\$[^$\d]{1,40}\$", " ", ans)  # "the domain of $f(x)$ is 19": math without a number is words
    if "$" in ans or "\\" in ans or not _has_prose(ans) or len(ans.split()) < 3 or _PERCENT_AFTER_RE.search(ans):
        return None  # "35 percent" is a percent answer, not the number 35
    if hedged(ans):
        return None  # "seven or 5", "maybe three, maybe 5", "probably 5 laps": a hedge names no one number
    nums = _NUMBER_RE.findall(ans)
    return nums[0] if len(nums) == 1 and len(re.findall(r"\d+", ans)) == len(re.findall(r"\d+", nums[0])) else None


# Words that make a short line of short words a sentence, not math ("it is 5", "not it's 10").
_SPOKEN_RE = re.compile(r"(?i)(?<![\\A-Za-z])(?:is|it|it's|its|are|was|the|not|no|we|so|be)(?![A-Za-z'])")


def answer_group(text: str):
    """(parts, ordered): answer_parts, and whether the parts are the ordered answers of a question's parts.
    None parts when there is no answer (or it is denied by the words after it)."""
    spans = _box_spans(text)
    box_pos = spans[-1][0] if spans else -1
    later = [(m.start(), "phrase", m) for m in _phrase_matches(text, max(box_pos, 0))]
    p = text.rfind("####")
    if p > box_pos:
        later.append((p, "hash", None))
    for pos, kind, m in sorted(later, key=lambda t: t[0], reverse=True):
        if kind == "hash":
            ans = text[pos + 4:].split("\n", 1)[0].strip()
        else:
            ans = _phrase_answer(text[m.end():m.end() + MAX_ANSWER_CHARS + 10])
        if ans and (box_pos < 0 or _gradeable(ans)):
            if box_pos < 0:
                ans = _number_in_words(ans) or ans
            return [ans], False
    if spans:
        if denied(text[spans[-1][1]:]):
            return None, False
        return _box_group(text, spans)
    bare = _bare_answer(text)
    if not bare or _SPOKEN_RE.search(bare):  # "it is 5, not 7" is a sentence of short words, not math
        bare = final_sentence_answer(text) or lone_statement_answer(text) or bare  # rules 3b and 3c
    return ([bare] if bare else None), False


# ``\$`` is a dollar sign inside the math, not a delimiter ("$ \frac12 \$ = \frac{10}{9} $")
_DELIMITED_RE = re.compile(r"\$\$(.+)\$\$|(?<!\\)\$(.+)(?<!\\)\$|\\\((.+)\\\)|\\\[(.+)\\\]", re.S)
_SEGMENT_RE = re.compile(r"\$\$([^$]+)\$\$|(?<!\\)\$((?:\\\$|[^$])+)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_UNIT_WORD_SET = None


def _has_prose(t: str) -> bool:
    """A run of 4+ letters outside LaTeX commands that is neither a math word nor a unit."""
    global _UNIT_WORD_SET
    if _UNIT_WORD_SET is None:
        _UNIT_WORD_SET = {w.rstrip("?").lower() for w in re.findall(r"[A-Za-z?]+", UNIT_WORDS)}
        _UNIT_WORD_SET |= {"percent", "percentage"}  # "28 percent" is 28 %
    bare = re.sub(r"\\(?:begin|end)\s*\{[A-Za-z*]*\}|\\[A-Za-z]+", " ", t)
    for w in re.findall(r"[A-Za-z]+", bare):
        lw = w.lower()
        if len(w) > 3 and lw not in MATH_WORDS and lw not in _UNIT_WORD_SET and lw.rstrip("s") not in _UNIT_WORD_SET:
            return True
    return False


_POINTING_TAIL_RE = re.compile(
    r"(?i)\s*(?:is|are)\s+(?:the|our|my)\s+(?:final\s+)?(?:answer|solution|result)s?\s*[.!]?\s*")


def _bare_answer(text: str):
    """A completion that is nothing but an answer (``5``, ``$x = 2$``, ``\\(\\frac12\\)``, ``Yes``).

    One line of at most BARE_MAX_CHARS characters, either wholly inside one math
    delimiter pair, or with no prose: every run of letters outside LaTeX commands
    is at most 3 letters long, a math word or a unit -- or at most two words
    and no digit (a text answer) -- or a sentence whose only math is one
    delimited segment at its end ("The answer is $5$.").  Prose without math
    markup such as "the answer is 42" is no answer.
    """
    t = text.strip()
    if not t or len(t) > BARE_MAX_CHARS or "\n" in t or "\\boxed" in t or "\\fbox" in t:
        return None
    m = _DELIMITED_RE.fullmatch(t)
    if m:
        inner = next(g for g in m.groups() if g is not None).strip()
        return inner if inner and "$" not in inner.replace("\\$", "") else None
    segs = list(_SEGMENT_RE.finditer(t))  # "The answer is $5$.": its one math segment, at the end
    # ... or before a short clause that points at it: "Therefore $x \ge 5$ is the solution."
    tail = t[segs[0].end():] if len(segs) == 1 else ""
    if (len(segs) == 1 and (re.fullmatch(r"[\s.!]*", tail) or _POINTING_TAIL_RE.fullmatch(tail))
            and re.search(r"[A-Za-z]{2}", t[:segs[0].start()])):
        inner = next(g for g in segs[0].groups() if g is not None).strip()
        return inner or None
    if not _has_prose(t):
        return t
    if len(t.split()) <= 2 and not re.search(r"\d", t):
        return t
    return None

"""Math answer extraction and equivalence grading for RLVR rewards.

Public API
----------
``extract_answer(text) -> str | None``
    The final answer of a completion (rules 1-3 below); ``None`` when there is none.

``math_reward(completion, reference) -> float``
    1.0 when the extracted answer is mathematically equivalent to the reference,
    else 0.0.  Never raises.

``is_equivalent(answer, reference) -> bool`` is public too.  Finding the answer
in the text (rules 1-3, and ``last_boxed``, which the data loader uses for
references) is pure string work in :mod:`grpo_dist.rewards.extract`.

Grading rules
-------------
A grader that pays for hedging teaches the policy to hedge, so every rule below
says both what is accepted and what is refused.  Each rule has pass and fail
cases in ``tests/data/math_cases_round2.jsonl`` and, for the issue-25 rules,
``tests/data/math_cases_round3.jsonl`` (the category in brackets), checked by
``tests/test_math_round2.py`` and ``tests/test_math_round3.py``; the rules marked
round 4 and round 5 have theirs in ``tests/test_math_round4.py`` and
``tests/test_math_round5.py``.

1. Which box counts [boxed_list, hedge].  The answer is the *last* ``\\boxed{}``
   / ``\\fbox{}`` together with the boxes chained to it: a box belongs to the
   group when the text between it and the next box of the group is at most
   MAX_GAP_CHARS characters of punctuation, ``$``, labels (``x =``, ``(b)``) and
   the joining words in ``_GAP_WORDS`` (and, or, maybe, possibly,
   alternatively, ...).  A group of several boxes is **one list answer**
   (boxes holding equivalent values count once): ``\\boxed{-4} and \\boxed{2}``
   equals the reference ``-4, 2`` but never ``2``.  An earlier box separated by
   other words ("then", a paragraph of work) is not part of the answer: the
   later box replaces it.  Only the last MAX_BOXES boxes are looked at.
   Boxes labelled as the parts of a question [multi_part] (``(a) \\boxed{12};
   (b) \\boxed{7}``, ``\\boxed{..} for part (a) and \\boxed{..}``) are compared
   with the reference's list *in order*, part by part; other groups in any
   order.  A box followed by words denying it (``\\boxed{C} is wrong``,
   ``..., no, that is not it``) is no answer [choice_denied].  In a *reference*
   every box of the last group is its answer, and a gap of a joining word and
   at most two other words also joins (``\\boxed{1} papers and \\boxed{2} bins``
   is ``1, 2``), as does a gap of symbols only (``\\boxed{35} ++++++ \\boxed{4}``).
2. Final-answer phrases [final_phrase].  ``Final answer: ...`` / ``final
   answer is ...`` / ``answer: ...`` / ``The answer is: ...`` (a colon is
   required after a bare "answer is"; prose such as "the answer is 42" is not a
   marker) and a GSM8K ``#### n`` line.  The marker that comes *last* in the
   text wins: a phrase after the last box replaces the box, provided its answer
   is math (a digit or a LaTeX command, and no prose word of 4+ letters other
   than math words and units) or an option letter, so "the answer is: correct"
   or "verify the answer: substitute x = 3 ..." after a box does not.  The phrase answer is the first ``$...$`` or
   the sentence up to its full stop; "The smallest $k$ is 12" gives ``12``.
   With no box, a phrase answer in words with exactly one number in it is that
   number [phrase_number]: "Final Answer: Jane started 3 hours ago" gives
   ``3``; two numbers ("3 laps in 4 minutes"), none ("three"), or a percent
   ("35 percent") keep the words.
3. Bare answers.  A completion with no box and no marker that is itself only
   an answer -- one line of at most BARE_MAX_CHARS characters, either wholly in
   one math delimiter pair or without prose words -- is its own answer
   (``5``, ``$x = 2$``, ``\\(\\frac12\\)``, ``Yes``); a one-line sentence whose only
   math is one delimited segment at its end gives that segment ("The answer is
   $5$." -> 5), also before a short clause pointing at it ("Therefore $x \\ge 5$
   is the solution.").  Sentences with several segments give no answer.
3c. One short statement [round 5, grpo_dist/rewards/prose.py].  A completion
   that is a single sentence of at most BARE_MAX_CHARS characters, with no box
   and no marker, answers with the one value it asserts: "the answer is 42",
   "We computed it and it is 5.", "the number is not 10 which is 1,000.99"
   (a value right after "not" is denied, not a candidate).  Refused: a hedge
   word or "?", a second candidate value ("the number is 10 which is 12"), a
   number in words, any other negation ("5 is not the answer"), denying words
   after the value, and a value no verb, "=" or ":" asserts ("Step 1: ...").
3b. Concluding sentence [round 4, grpo_dist/rewards/prose.py].  With no box, no
   marker and no bare answer, the last sentence of a *worked* solution (at
   least one sentence before it) that opens with therefore / thus / hence / so
   / finally ... and is complete (a full stop) states the answer: its last
   value, skipping values after "not"; values joined to it by "and" / "," are
   one list.  A hedge word or "?" in it, denying words after the value, or a
   completion cut mid-sentence give no answer.  Text after the first
   end-of-turn token (``<|im_end|>``, ``<|im_start|>`` ...) is never read.
4. Lists vs single values [hedge].  A comma / ``and`` / ``or`` / ``\\lor`` /
   ``\\vee`` / ``(or ...)`` / ``\\pm`` list is compared with the reference as a
   list (unordered, same length) and **never equals a single value**:
   ``7 or 9``, ``2 \\lor 8``, ``20 (or 21)``, ``\\pm 5`` all get 0 against one of
   their values and 1 against the reference list.  Tuples and intervals are
   ordered and their brackets must match; sets are unordered and deduplicated.
   A list whose items are all one value (``\\frac12 or 0.5``) is that value.
   Solution sets [solution_set]: a list joined by ``,`` ``;`` ``or`` ``and``
   (also written ``(11,7)or(7,11)``) or in set braces equals the same
   solutions in any order, a solution listed twice counting once; each tuple
   inside stays ordered (``(3,1) or (4,2)`` is not ``(1,3),(4,2)``).  The
   grader never sees the problem, so a reference list is read as "all the
   solutions"; a question whose answer is one ordered tuple writes it in
   brackets.
5. Multiple choice [choice].  When the reference is an option letter (``C``,
   ``(C)``, ``\\text{(C)}``) the answer must name **exactly one** option and it
   must be that one.  Options are ``(X)`` or a lone capital letter (``C.``,
   ``C:``, ``C 7``); ``(A)(B)(C)(D)(E)``, ``(B) or (C)``, ``C. 7, D. 9`` and
   "(C) is wrong, the answer is (D)" name several and get 0; an answer that
   names the option with a denial (``(C) is not correct``, "C, no, that is
   wrong") gets 0.  A reference
   that gives the option and its value (``\\textbf{(C) } 12``) accepts an answer
   naming only that option, or, when the answer names no option, its value.
6. Labels and chains [labelled, chained].  A label on the left -- a variable,
   ``a_1``, a product of letters (``PQ``, ``g(x)``, ``f^{-1}(x)``, ``\\angle ABC``,
   ``\\overline{AB}``) or a tuple of them
   (``(m,n)``) -- is dropped when the other side has none: ``(m,n)=(4,1)``
   equals ``(4,1)``, ``PQ=6, RS=7`` equals ``6, 7`` *in that order* (labelled
   assignments vs a bare list are compared in order).  A length ``|AB| = 1``
   and a labelled ratio ``V_1:V_2 = 11:21`` equal ``1`` and ``11:21``.
   Assignments that repeat their labels are one tuple per solution, in the
   labels' order: ``p=5,q=2; p=7,q=2`` is ``(5,2), (7,2)`` [assignment].
   **An equality chain answers with its last side** [chained,
   chain_last_side], the rule math-verify follows: the sides before it are the
   work (``y = 3+4+2 = 9`` -> 9, ``x = 5+5+1 = 7 = 11`` -> 11, ``3+4 = 8`` -> 8,
   ``1 = k = x = 0`` -> 0), and a chain names one value, so it cannot hedge
   (``y = 3 = 4`` is 4, never 3).  ``\\approx`` ends the chain: the answer is the
   exact side before the first one (``\\frac13 \\approx 0.33`` -> 1/3, not 0.33).
   A two-sided equation that is not a label and a value (``x^2 = 4``,
   ``x+y=5``) is an equation, not a value.
7. Inequalities [inequality].  Chains are read in < direction (``5 > x > 1``
   is ``1 < x < 5``); two one-relation inequalities are equal when their sides
   differ by the same positive factor (``-x > -3`` = ``x < 3``, ``2x-4 \\ge 0`` =
   ``x \\ge 2``; a negative factor flips the meaning and is refused).  A one-
   variable inequality equals the interval it defines (``1 \\le x < 5`` =
   ``[1, 5)``, ``2x - 4 \\ge 0`` = ``[2, \\infty)``, ``|x| \\le 2`` = ``[-2, 2]``,
   ``|x-1| > 2`` and ``x < -1 or x > 3`` = ``(-\\infty,-1) \\cup (3,\\infty)``).
   The function or quantity an inequality names is its variable
   [interval_function]: ``0 < f(x) < 1`` = ``(0, 1)``, ``f(x) > 1`` =
   ``(1, \\infty)``; ``x \\in S`` is ``S``.  A band of an absolute value
   [abs_union] is the union it defines: ``1 \\le |z| \\le 5`` =
   ``[-5,-1] \\cup [1,5]`` (bounds and their brackets must match).
8. Number formats [number_format, repeating_decimal, percent_words,
   units_text].  Thousands separators ``,``, ``{,}``, ``\\,``, ``\\ `` and plain
   spaces (``2 500``) are dropped (groups of exactly three digits).  A decimal
   comma (``3,5``, ``0,75``) is read as a decimal point only when the other side
   is a single value (has no comma) -- ``1,500`` is always fifteen hundred.
   ``0.\\overline{6}`` / ``0.8\\overline{3}`` / ``0.(6)`` are the exact fractions.
   ``35 percent`` / ``35 pct`` / ``35 percentage`` are ``35\\%`` (which matches
   ``35`` and ``0.35``) [percent_word].  A doubly escaped string (``\\\\frac``)
   is read as LaTeX outside matrices [over_escaped].
   Units in ``\\text``/``\\textnormal``/``\\mathrm`` and common unit words after a
   number are dropped.
9. Sets [set_notation].  ``{2, 5}`` with bare braces is the set ``\\{2, 5\\}``,
   except against a reference tuple ``(2, 5)``: in LaTeX bare braces are a
   group and ``${2,5}$`` renders as 2,5, so the answer equals the pair in its
   written order (``{5,2}`` does not) [round 5];
   ``\\mathbb{R}``, ``ℝ`` and "all real numbers" are ``(-\\infty, \\infty)``;
   ``\\{1,2\\} \\cup \\{3\\}`` is ``\\{1,2,3\\}``; a set-builder ``\\{x \\mid x > 2\\}`` is
   its condition (so it equals ``(2, \\infty)``).  Set braces doubled, or with
   a TeX group inside (``\\{\\{1,4\\}\\}``, ``\\{{1,4}\\}``, ``{{1,4}}``), are one
   set [set_braces]; ``\\{\\{1\\},\\{4\\}\\}`` stays a set of sets (``\\{1\\}`` is not
   ``1`` inside a set).
10. Unicode [unicode].  Zero-width characters are dropped, ``x²`` is ``x^{2}``,
    ``½`` is ``\\frac{1}{2}`` (``2½`` = 5/2), ``−``, ``×``, ``π``, ``√``, ``≤`` ...
    become LaTeX, then NFKC folds full-width digits (``１２`` = 12).
11. Size guards [size_guard].  Every guard of :mod:`grpo_dist.rewards.parser`
    stays (input length, token count, nesting, number size checked *before* a
    power / factorial / product is built, bounded numeric evaluation), with
    limits that let moderate exact arithmetic through: integers up to 2^17 bits
    (``2^{2^{2^{2^2}}}`` = ``2^{65536}``), 48 bracket levels, 1000 tokens (sums
    of a few hundred terms, built in one ``Add``).  Anything larger is refused
    and graded 0 in milliseconds (``10^{10^{10}}``).

How equivalence is decided
--------------------------
Both sides are cleaned (``$``, ``\\left``/``\\right``, spacing macros, ``\\text``
units, degrees, separators, a trailing period ...) and parsed by the restricted
parser in :mod:`grpo_dist.rewards.parser` (no ``eval``/``sympify``).  Then:

* plain numbers are compared as exact fractions;
* constant expressions are compared exactly (sympy's automatic simplification)
  and, failing that, numerically at 50 significant digits with a relative
  tolerance of 1e-20 (two different closed forms of one number, e.g.
  ``\\sqrt{8}`` and ``2\\sqrt2``);
* expressions with variables are compared by evaluating both at several fixed
  generic points (a randomised identity test; no ``simplify``, so it is bounded);
* equations compare their right-hand sides when the left side is the same
  label (``x = 5`` vs ``5``), else ``lhs - rhs`` up to a constant factor;
* a sum or product over an index (``\\sum_{k=0}^{n-1} F_k F_{n-k-1}``) is never
  evaluated: it equals only the same sum, factors and terms in any order
  (``F_{n-k-1} F_k``), and a subscript such as ``n-k-1`` is part of a name
  [round 5];
* matrices compare element-wise; percent answers match both ``p`` and
  ``p/100``; text answers compare case-insensitively.

Decimal tolerance rule
----------------------
Decimals are read exactly (``0.15`` is 3/20), so a decimal equals a fraction or
another decimal only if it is the same number (``0.5`` = ``1/2``, ``1.25`` !=
``1.2500001``, ``5`` = ``5.0``).  Only when one side contains a decimal literal
**and** the other side's exact value has no finite decimal expansion (``1/3``,
``\\pi``, ``\\sqrt2``) is a rounded value accepted, and then only within a relative
error of 1e-4 (about five significant figures): ``0.33333`` and ``3.1416`` are
accepted for ``1/3`` and ``\\pi``, ``0.333``, ``3.14`` and ``1.414`` are not.
Integers never get a tolerance (``6366`` is not ``20000/\\pi``).
"""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from functools import lru_cache

import mpmath
import sympy

from grpo_dist.rewards.extract import (
    MATH_WORDS, MAX_ANSWER_CHARS, UNIT_WORDS, answer_group, answer_parts, reference_boxes, split_top_level,
)
from grpo_dist.rewards.parser import (
    EVAL_DPS, BraceSet, EvalError, Matrix, Multi, ParseError, Rel, SetV, Tup, UnionV, mp_eval, parse,
)
from grpo_dist.rewards.prose import end_of_turn

__all__ = ["extract_answer", "math_reward", "evaluated_math_reward", "is_equivalent", "clean_answer",
           "DECIMAL_REL_TOL"]

DECIMAL_REL_TOL = 1e-4     # decimal vs. non-terminating exact value
EXACT_REL_TOL = 1e-20      # two exact closed forms, compared at 50 digits
POINT_REL_TOL = 1e-12      # expressions with variables, at generic points
MAX_ITEMS = 64             # answers in a list / set / tuple / matrix

# --------------------------------------------------------------------------- extraction

def _dedupe_answers(parts: list) -> list:
    out: list = []
    for a in parts:
        if not a:
            continue
        if not any(a == b or is_equivalent(a, b) for b in out):
            out.append(a)
    return out


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None (see module docstring).

    A group of several boxes is returned as one comma-separated list (boxes
    holding equivalent values are kept once).
    """
    if not isinstance(text, str) or not text:
        return None
    text = normalize_unicode(end_of_turn(text))
    parts = answer_parts(text)
    if not parts:
        return None
    parts = _dedupe_answers(parts) if len(parts) > 1 else parts
    return ", ".join(parts) if parts else None


def _reference_answer(reference: str) -> str:
    reference = normalize_unicode(reference)
    reference = re.sub(r"\\\\(?=(?:boxed|fbox|text)\b)", r"\\", reference)  # "\\boxed": escaped twice
    reference = _close_reference_box(reference)
    boxes = reference_boxes(reference) if "\\boxed" in reference or "\\fbox" in reference else []
    if len(boxes) > 1:  # "\boxed{1} papers and \boxed{2} bins": one answer of several values, in order
        return ", ".join(c.strip() for c in boxes)
    if "\\boxed" in reference or "\\fbox" in reference or "####" in reference or _WORKED_RE.search(reference):
        ans = extract_answer(reference)  # a worked solution: its final answer
        if ans is not None:
            return ans.strip()
    return reference.strip()


_WORKED_RE = re.compile(r"(?i)final\s+answer")


def _close_reference_box(reference: str) -> str:
    """A reference's last box that is never closed runs to the end of the reference (a dataset's truncated
    ``\\boxed{W(n) = 1 \\text{ and } W(n) = -1``).  References only: an unclosed box in a completion is no
    answer."""
    p = max(reference.rfind("\\boxed{"), reference.rfind("\\fbox{"))
    if p < 0:
        return reference
    tail = reference[p:]
    depth = tail.count("{") - tail.count("\\{") - (tail.count("}") - tail.count("\\}"))
    return reference + "}" * depth if 0 < depth <= 3 else reference


# --------------------------------------------------------------------------- cleaning
_UNICODE = [
    ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "*"), ("\u22c5", "*"), ("\u00b7", "*"),
    ("\u00f7", "/"), ("\u03c0", "\\pi "), ("\u221e", "\\infty "), ("\u221a", "\\sqrt"),
    ("\u2264", "\\le "), ("\u2265", "\\ge "), ("\u2260", "\\ne "), ("\u00b0", "^\\circ "),
    ("\u222a", "\\cup "), ("\u00a0", " "), ("\u2009", " "), ("\u202f", " "),
    ("\u211d", "\\mathbb{R}"), ("\u2248", "\\approx "), ("\u2228", "\\lor "), ("\u2044", "/"),
]
_ZERO_WIDTH_RE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_SUPERSCRIPTS = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b\u207a"
_SUP_RE = re.compile("[" + _SUPERSCRIPTS + "]+")
_SUP_MAP = str.maketrans(_SUPERSCRIPTS, "0123456789-+")
_VULGAR_RE = re.compile("[\u00bc-\u00be\u2150-\u215e]")


def normalize_unicode(s: str) -> str:
    """Unicode answers to ASCII LaTeX: superscripts, vulgar fractions, math symbols, NFKC.

    Zero-width characters are dropped, ``x²`` becomes ``x^{2}``, ``½`` becomes
    ``\\frac{1}{2}`` (so ``2½`` is the mixed number 5/2), then NFKC folds
    full-width digits and letters to ASCII.  ASCII text is returned unchanged.
    """
    if s.isascii():
        return s
    s = _ZERO_WIDTH_RE.sub("", s)
    s = _SUP_RE.sub(lambda m: "^{" + m.group(0).translate(_SUP_MAP) + "}", s)
    s = _VULGAR_RE.sub(lambda m: "\\frac{{{}}}{{{}}}".format(
        *unicodedata.normalize("NFKC", m.group(0)).split("\u2044")), s)
    for a, b in _UNICODE:
        if a in s:
            s = s.replace(a, b)
    s = unicodedata.normalize("NFKC", s)
    return s.replace("\u2044", "/")


_WRAPPERS = (r"(?:text|textbf|textit|textrm|textsf|texttt|textnormal|textup|mbox|mathrm|mathbf|mathit|"
             r"mathsf|mathtt|mathnormal|boldsymbol|bm|operatorname|emph|hbox)")
_UNIT_TAIL_RE = re.compile(
    r"(?<=[\d}.])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:" + UNIT_WORDS + r")(?:\s*\^\s*\{?\s*[23]\s*\}?|[23])?\s*$",
    re.I,
)
_TEXT_UNIT_RE = re.compile(
    r"(?<=[\d}).])\s*\\" + _WRAPPERS + r"\s*\{\s*(?:[A-Za-z][A-Za-z .]+|[mgsLh])\s*\}(?:\s*\^\s*\{?\s*[23]\s*\}?)?"
)
_PERCENT_WORDS = r"(?:percentage(?:\s+points?)?|percent|per\s*cent|pct)"
_PERCENT_WORD_RE = re.compile(
    r"(?<=[\d}.])\s*(?:\\" + _WRAPPERS + r"\s*\{\s*" + _PERCENT_WORDS + r"\.?\s*\}|"
    + _PERCENT_WORDS + r"\.?(?![A-Za-z]))", re.I)
_TEXT_CONNECT_RE = re.compile(r"\\" + _WRAPPERS + r"\s*\{\s*(?:and|or|,)\s*\}")
_UNWRAP_RE = re.compile(r"\\" + _WRAPPERS + r"\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:,\d{3})+(?![\d])(?!\.\d*,)")
_SPACE_THOUSANDS_RE = re.compile(r"(?<![\d.,])[1-9]\d{0,2}(?: \d{3})+(?![\d/])")
_REPEATING_RE = re.compile(r"(\d*)\.(\d*)(?:\\overline\s*(?:\{\s*(\d{1,40})\s*\}|(\d))|\((\d{1,40})\))")
_REALS_RE = re.compile(r"\\mathbb\s*(?:\{\s*R\s*\}|R)")
_REALS_TEXT_RE = re.compile(r"(?i)(?:the\s+set\s+of\s+)?(?:all\s+)?real(?:\s+numbers|s)")
_TRIG_DEG_RE = re.compile(  # sin 30^\circ: a trig argument in degrees
    r"(\\(?:sin|cos|tan|cot|sec|csc)\s*\(?\s*)(\d+(?:\.\d+)?)\s*(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\degree)")
_ANSWER_IS_RE = re.compile(r"(?i)^(?:so\s+|thus\s+|hence\s+)?(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*(?=\S)")
_SET_BUILDER_RE = re.compile(
    r"\\\{\s*[A-Za-z](?:\s*\\in\s*\\mathbb\s*\{?\s*R\s*\}?)?\s*(?:\\mid|\||:)\s*(.+?)\s*\\\}")
_CHOOSE_RE = re.compile(r"\{\s*([^{}]+?)\s*\\choose\s*([^{}]+?)\s*\}")
_OR_PAREN_RE = re.compile(r"\(\s*or\s+([^()]*)\)")


def _repeating(m) -> str:
    """``0.8\\overline{3}`` -> ``\\frac{5}{6}`` (exact, so no decimal tolerance applies)."""
    ip, nonrep = m.group(1) or "0", m.group(2)
    rep = m.group(3) or m.group(4) or m.group(5)
    k, n = len(rep), len(nonrep)
    num = int(ip + nonrep + rep) - int(ip + nonrep)
    val = Fraction(num, 10 ** n * (10 ** k - 1))
    return f"\\frac{{{val.numerator}}}{{{val.denominator}}}" if val.denominator != 1 else str(val.numerator)


_SET_OPEN = r"(?:\\\{\s*\\\{|\\\{\s*\{|\{\s*\\\{|\{\s*\{)"
_SET_CLOSE = r"(?:\\\}\s*\\\}|\}\s*\\\}|\\\}\s*\}|\}\s*\})"
_DOUBLED_BRACES_RE = re.compile(_SET_OPEN + r"((?:(?!\\?[{}]).)*)" + _SET_CLOSE)


def _doubled_braces(s: str) -> str:
    """``\\{\\{1,4\\}\\}``, ``\\{{1,4}\\}``, ``{{1,4}}`` -> ``\\{1,4\\}``: set braces doubled (or a TeX group
    inside them) around items that hold no braces, a whole answer only; ``\\{\\{1\\},\\{4\\}\\}`` stays a set of
    sets."""
    m = _DOUBLED_BRACES_RE.fullmatch(s.strip())
    return f"\\{{{m.group(1)}\\}}" if m else s


def _strip_thousands(s: str) -> str:
    out, last = [], 0
    for m in _THOUSANDS_RE.finditer(s):
        prefix = s[:m.start()]
        depth = sum(prefix.count(c) for c in "([{") - sum(prefix.count(c) for c in ")]}")
        if depth > 0:
            continue
        out.append(s[last:m.start()])
        out.append(m.group(0).replace(",", ""))
        last = m.end()
    out.append(s[last:])
    return "".join(out)


def clean_answer(s: str) -> str:
    """Strip LaTeX noise, units, degrees and separators from an answer string."""
    s = normalize_unicode(s)
    if "\\begin" not in s:  # \\frac (a doubly escaped string) is \frac; in a matrix \\ ends a row
        s = re.sub(r"\\\\(?=[A-Za-z])", r"\\", s)
    s = s.replace("\\$", " ").replace("$", " ")
    s = re.sub(r"\\[\[\]()]", " ", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg|displaystyle|textstyle)(?![A-Za-z])", "", s)
    s = s.replace("\\\\", "\x01")  # protect LaTeX row separators
    s = re.sub(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d)", ",", s)  # 14{,}916, 14 {, }916
    s = s.replace("{,}", ",")
    s = re.sub(r",\\!\s*", ",", s)
    s = re.sub(r"\\[,!]", "", s)  # thin spaces: thousands separators (12\\,345)
    s = re.sub(r"\\[;:]", " ", s)
    s = re.sub(r"\\ |\\q?quad|~", " ", s)  # \quadx_2: a space, even when a letter follows
    s = _TRIG_DEG_RE.sub(lambda m: f"{m.group(1)}\\frac{{{m.group(2)}\\pi}}{{180}}", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"(?<![A-Za-z\\])([A-Za-z])\s*(?:'|\^\s*\{?\s*\\prime\s*\}?)", r"\1_p", s)  # f'(x)
    s = _CHOOSE_RE.sub(r"\\binom{\1}{\2}", s)
    s = s.replace("\\%", "%")
    s = _PERCENT_WORD_RE.sub("%", s)
    s = _TEXT_CONNECT_RE.sub(",", s)
    s = _TEXT_UNIT_RE.sub("", s)
    for _ in range(3):
        s2 = _UNWRAP_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    s = s.strip()
    s = _ANSWER_IS_RE.sub("", s)
    s = re.sub(r"[.\s]+$", "", s) if not re.search(r"\d\.$", s) else s[:-1]
    m = _SET_BUILDER_RE.fullmatch(s)
    if m:  # {x | x > 2}: the condition
        s = m.group(1)
    s = re.sub(r"^[A-Za-z]\s*\\in\s*", "", s)
    s = _REALS_RE.sub(lambda m: "(-\\infty,\\infty)", s)
    if _REALS_TEXT_RE.fullmatch(s):
        s = "(-\\infty,\\infty)"
    s = re.sub(r"\\(?:lor|vee)(?![A-Za-z])", ",", s)
    s = _OR_PAREN_RE.sub(r",\1", s)
    s = re.sub(r"(?i)^either\s+", "", s)
    s = re.sub(r"\s+(?:and|or)\s+", ",", s)
    s = re.sub(r"(?<=[)\]])\s*(?:and|or)\s*(?=[(\[])", ",", s)  # (11,7)or(7,11)
    s = re.sub(r"(?<=\d)\s*or\s*(?=[A-Za-z(]\s*(?:\(\s*[A-Za-z]\s*\)\s*)?=)", ",", s)  # W(x)=1orW(x)=-1
    s = _doubled_braces(s)
    s = _REPEATING_RE.sub(_repeating, s)
    s = _UNIT_TAIL_RE.sub("", s).strip()
    s = re.sub(r"\s*(?:degrees?|percent)$", "", s)
    s = _strip_thousands(s)
    s = _SPACE_THOUSANDS_RE.sub(lambda m: m.group(0).replace(" ", ""), s)
    s = s.replace("\x01", "\\\\")
    m = re.fullmatch(r"(-?\d+)\s+(\d+)\s*/\s*(\d+)", s)  # "1 1/2"
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"
    return s.strip()


# --------------------------------------------------------------------------- parsing
_PLAIN_NUM_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_CHOICE_RE = re.compile(r"\(?\s*([A-Z])\s*\)?")


class _Text:
    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s


def _text_key(s: str) -> str:
    s = s.lower()
    s = re.sub(r"\\[a-z]+", "", s)
    return re.sub(r"[\s{}()\\.,;:!?'\"]", "", s)


def _looks_like_text(s: str) -> bool:
    words = re.findall(r"[A-Za-z]+", s)
    if not words or re.search(r"[^A-Za-z\s\-']", s):
        return False
    return any(len(w) >= 3 and w.lower() not in MATH_WORDS for w in words)


@lru_cache(maxsize=4096)
def _parse_cached(s: str, percent_div: bool):
    try:
        return parse(s, percent_div=percent_div)
    except (ParseError, RecursionError, TypeError, ValueError, ArithmeticError,
            AttributeError, IndexError, KeyError, MemoryError):
        return None


def _candidates(cleaned: str):
    """Parsed readings of an answer: [(value, has_decimal)], 2 readings for percents."""
    if _looks_like_text(cleaned):
        return [(_Text(_text_key(cleaned)), False)]
    out = []
    modes = (True, False) if "%" in cleaned else (True,)
    for mode in modes:
        r = _parse_cached(cleaned, mode)
        if r is not None:
            out.append(r)
    return out


# --------------------------------------------------------------------------- comparison
_POINT_VALUES = [
    ["0.5372", "1.8339", "2.2588", "0.8622", "1.3188", "2.6077", "0.6694", "1.9494"],
    ["1.2146", "0.7275", "2.4412", "1.6103", "0.9438", "2.1193", "1.4451", "0.6061"],
    ["2.3279", "1.1124", "0.7812", "2.0457", "1.5832", "0.9911", "2.7148", "1.2817"],
    ["0.9146", "2.4875", "1.3716", "0.6383", "2.2264", "1.7742", "1.0533", "2.9108"],
]


def _numeric(expr, subs=None):
    """Bounded numeric value of expr (mpmath) or None when undefined / out of range."""
    try:
        return mp_eval(expr, subs)
    except (EvalError, ArithmeticError, ValueError, TypeError, RecursionError):
        return None


def _point(syms, row):
    return {s: mpmath.mpf(row[k]) for k, s in enumerate(syms)}


def _finite_decimal(x) -> bool:
    if not x.is_Rational:
        return False
    q = int(x.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _close(va, vb, tol) -> bool:
    with mpmath.workdps(EVAL_DPS):
        scale = max(abs(va), abs(vb))
        return abs(va - vb) <= tol * scale if scale > 0 else True


def expr_equiv(a, b, dec: bool) -> bool:
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False
    free = a.free_symbols | b.free_symbols
    if not free:
        if a.is_Rational and b.is_Rational:
            if a == b:
                return True
            if not dec or (_finite_decimal(a) and _finite_decimal(b)):
                return False
            va, vb = mpmath.mpf(a.p) / a.q, mpmath.mpf(b.p) / b.q
            return _close(va, vb, DECIMAL_REL_TOL)
        va, vb = _numeric(a), _numeric(b)
        if va is None or vb is None:
            return False
        if _close(va, vb, EXACT_REL_TOL):
            return True
        if dec and not (_finite_decimal(a) and _finite_decimal(b)):
            return _close(va, vb, DECIMAL_REL_TOL)
        return False
    if len(free) > 8:
        return False
    syms = sorted(free, key=lambda s: s.name)
    good = 0
    tol = DECIMAL_REL_TOL if dec else POINT_REL_TOL
    for row in _POINT_VALUES:
        subs = _point(syms, row)
        va, vb = _numeric(a, subs), _numeric(b, subs)
        if va is None and vb is None:
            continue
        if va is None or vb is None:
            return False
        if not _close(va, vb, tol):
            return False
        good += 1
    return good >= 2


def _ratio_const(d1, d2, positive: bool = False) -> bool:
    """d1 == c * d2 for a nonzero constant c (c > 0 when ``positive``): one relation written twice."""
    free = d1.free_symbols | d2.free_symbols
    if not free or len(free) > 8:
        return False
    syms = sorted(free, key=lambda s: s.name)
    ratio = None
    good = 0
    for row in _POINT_VALUES:
        subs = _point(syms, row)
        v1, v2 = _numeric(d1, subs), _numeric(d2, subs)
        if v1 is None or v2 is None or abs(v2) < mpmath.mpf(10) ** -25:
            continue
        r = v1 / v2
        if abs(r) < mpmath.mpf(10) ** -25:
            return False
        if ratio is None:
            ratio = r
        elif not _close(r, ratio, POINT_REL_TOL):
            return False
        good += 1
    if positive and ratio is not None and (abs(mpmath.im(ratio)) > abs(ratio) * POINT_REL_TOL
                                           or mpmath.re(ratio) <= 0):
        return False
    return good >= 2


_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!=", "approx": "approx"}
_INEQ_OPS = ("<", "<=", ">", ">=")


def _const(v) -> bool:
    return isinstance(v, sympy.Expr) and not v.free_symbols


def _is_label(v) -> bool:
    """A name on the left of an answer: x, a_1, g(x), PQ, (m, n) -- symbols only, no numbers."""
    if isinstance(v, Tup):
        return v.left == "(" and v.right == ")" and all(_is_label(x) for x in v.items)
    if isinstance(v, sympy.Symbol):
        return True
    if isinstance(v, sympy.Abs):  # |AB|: a length
        return _is_label(v.args[0])
    return isinstance(v, sympy.Mul) and all(  # PQ, g(x), f^{-1}(x)
        isinstance(x, sympy.Symbol) or (x.is_Pow and x.base.is_Symbol and x.exp == -1) for x in v.args)


def _is_ineq(r) -> bool:
    return isinstance(r, Rel) and all(op in _INEQ_OPS for op in r.ops)


def _rel_value(r: Rel):
    """The value an equality chain states, for comparison with a plain answer.

    ``x = 5`` -> 5, ``(m,n) = (4,1)`` -> (4,1), ``y = 3+4+2 = 9`` -> 9, ``x = 2+2 = 5`` -> 5 (the last
    side, as math-verify reads it: the sides before it are the work), ``\\frac18 \\approx 0.3`` -> 1/8 (the
    exact side before the first ``\\approx``), ``x \\in [1,2]`` -> [1,2]; None when it is no value
    (``x^2 = 4``, ``x + y = 5``, inequalities).
    """
    if r.ops == ["in"]:
        return r.parts[1] if isinstance(r.parts[0], sympy.Symbol) else None
    if not all(op in ("=", "approx") for op in r.ops):
        return None
    parts, ops = list(r.parts), list(r.ops)
    labelled = _is_label(parts[0])
    if labelled:
        parts, ops = parts[1:], ops[1:]
    elif len(parts) == 2 and _is_label(parts[1]) and ops[0] == "=":
        return parts[0]  # 5 = x
    k = ops.index("approx") if "approx" in ops else len(ops)
    exact = parts[:k + 1]  # what follows the first \approx is a rounding of it, not the answer
    value = exact[-1]
    if labelled or len(exact) == 1:
        return value
    if _const(value) and (len(exact) > 2 or _const(exact[0])):
        return value  # 3+4 = 7, 1 = k = x = 0: the last side; x^2 = 4 stays an equation
    return None


def _norm_chain(r: Rel):
    """An inequality chain written with < / <= (``5 > x > 1`` -> ``1 < x < 5``)."""
    if all(op in (">", ">=") for op in r.ops):
        return list(reversed(r.parts)), [_FLIP[op] for op in reversed(r.ops)]
    return list(r.parts), list(r.ops)


def _linear(e):
    """(x, k, b) when e == k*x + b for one symbol x and real constants k != 0, b; else None."""
    if not isinstance(e, sympy.Expr) or len(e.free_symbols) != 1:
        return None
    x = next(iter(e.free_symbols))
    k = e.diff(x)
    if k.free_symbols or not k.is_real or k == 0:
        return None
    b = sympy.expand(e - k * x)
    if b.free_symbols or not b.is_real:
        return None
    return x, k, b


def _iv(lo, hi, lo_strict, hi_strict):
    return Tup([lo, hi], "(" if lo_strict else "[", ")" if hi_strict else "]")


def _interval(r: Rel):
    """The set a one-variable inequality defines, as an interval or a union of two.

    ``x < 3`` -> (-oo, 3), ``1 <= x < 5`` -> [1, 5), ``2x - 4 >= 0`` -> [2, oo),
    ``|x| <= 2`` -> [-2, 2], ``|x - 1| > 2`` -> (-oo, -1) U (3, oo); None otherwise.
    """
    if not _is_ineq(r):
        return None
    parts, ops = _norm_chain(r)
    if not all(op in ("<", "<=") for op in ops):
        return None
    # the function (or quantity) an inequality names is its variable: 0 < f(x) < 1 is the interval (0, 1)
    parts = [_VAR if _is_label(p) and not isinstance(p, (sympy.Symbol, sympy.Abs, Tup)) else p for p in parts]
    if len(parts) == 3 and _const(parts[0]) and _const(parts[2]) and isinstance(parts[1], sympy.Abs):
        return _abs_band(parts[1], parts[0], parts[2], ops[0] == "<", ops[1] == "<")
    if len(parts) == 3 and _const(parts[0]) and _const(parts[2]):
        lin = _linear(parts[1])
        if lin is None:
            return None
        _, k, b = lin
        lo, hi = (parts[0] - b) / k, (parts[2] - b) / k
        s_lo, s_hi = ops[0] == "<", ops[1] == "<"
        if k.is_negative:
            lo, hi, s_lo, s_hi = hi, lo, s_hi, s_lo
        return _iv(lo, hi, s_lo, s_hi)
    if len(parts) != 2:
        return None
    strict = ops[0] == "<"
    left, right = parts
    for side, const, abs_small in ((left, right, True), (right, left, False)):
        # abs_small: |u| < c (the Abs on the left of <), else c < |u|
        if isinstance(side, sympy.Abs) and _const(const):
            lin = _linear(side.args[0])
            if lin is None or not const.is_positive:
                return None
            _, k, b = lin
            lo, hi = sorted([(-const - b) / k, (const - b) / k], key=lambda v: float(v))
            if abs_small:
                return _iv(lo, hi, strict, strict)
            return UnionV([_iv(-sympy.oo, lo, True, strict), _iv(hi, sympy.oo, strict, True)])
    if not (_const(left) or _const(right)):
        return None
    lin = _linear(left - right)
    if lin is None:
        return None
    _, k, b = lin
    root = -b / k
    if k.is_positive:   # k x + b < 0  ->  x < root
        return _iv(-sympy.oo, root, True, strict)
    return _iv(root, sympy.oo, strict, True)


_VAR = sympy.Symbol("_v", real=True)


def _abs_band(side, lo, hi, s_lo: bool, s_hi: bool):
    """``lo < |k x + b| <= hi`` (0 < lo < hi): the union of the two intervals it defines, lower one first."""
    lin = _linear(side.args[0])
    if lin is None or not (lo.is_positive and (hi - lo).is_positive):
        return None
    _, k, b = lin
    bands = [(lo, hi, s_lo, s_hi), (-hi, -lo, s_hi, s_lo)]  # u = k x + b in [lo, hi] or in [-hi, -lo]
    ivs = []
    for u_lo, u_hi, strict_lo, strict_hi in bands:
        x_lo, x_hi = (u_lo - b) / k, (u_hi - b) / k
        if k.is_negative:
            x_lo, x_hi, strict_lo, strict_hi = x_hi, x_lo, strict_hi, strict_lo
        ivs.append(_iv(x_lo, x_hi, strict_lo, strict_hi))
    ivs.sort(key=lambda t: float(t.items[0]))
    return UnionV(ivs)


def _ineq_equiv(a: Rel, b: Rel, dec: bool) -> bool:
    pa, oa = _norm_chain(a)
    pb, ob = _norm_chain(b)
    if oa != ob or len(pa) != len(pb):
        return False
    if all(values_equiv(x, y, dec) for x, y in zip(pa, pb)):
        return True
    if len(pa) == 2 and all(isinstance(x, sympy.Expr) for x in pa + pb) and oa[0] in ("<", "<="):
        # L < R  <=>  R - L > 0: the same if the differences agree up to a positive factor
        return _ratio_const(pa[1] - pa[0], pb[1] - pb[0], positive=True)
    return False


def _rel_equiv(a: Rel, b: Rel, dec: bool) -> bool:
    if _is_ineq(a) or _is_ineq(b):
        return _is_ineq(a) and _is_ineq(b) and _ineq_equiv(a, b, dec)
    if len(a.parts) == 2 and len(b.parts) == 2 and _rel_equiv2(a, b, dec):
        return True
    # chains / labels: x = 2+3 = 5 vs x = 5
    if _is_label(a.parts[0]) and _is_label(b.parts[0]) and values_equiv(a.parts[0], b.parts[0], dec):
        va, vb = _rel_value(a), _rel_value(b)
        return va is not None and vb is not None and values_equiv(va, vb, dec)
    return False


def _rel_equiv2(a: Rel, b: Rel, dec: bool) -> bool:
    (al, ar), (bl, br) = a.parts, b.parts
    aop = "=" if a.ops[0] == "approx" else a.ops[0]
    bop = "=" if b.ops[0] == "approx" else b.ops[0]
    if aop != bop:
        return False
    if aop == "=" and isinstance(br, sympy.Symbol) and not isinstance(bl, sympy.Symbol):
        bl, br = br, bl
    if aop == "=" and isinstance(ar, sympy.Symbol) and not isinstance(al, sympy.Symbol):
        al, ar = ar, al
    if values_equiv(al, bl, dec) and values_equiv(ar, br, dec):
        return True
    if aop in ("=", "!=") and all(isinstance(x, sympy.Expr) for x in (al, ar, bl, br)):
        if isinstance(al, sympy.Symbol) and al == bl:
            return False  # same variable, different right-hand sides
        return _ratio_const(al - ar, bl - br)
    return False


def _labelled_assignment(m) -> bool:
    """``PQ=6, RS=7`` / ``x=5, y=-2``: every item assigns a value to a different label."""
    if not all(isinstance(x, Rel) and x.ops[0] == "=" and _is_label(x.parts[0]) for x in m.items):
        return False
    labels = [x.parts[0] for x in m.items]
    return len(set(map(str, labels))) == len(labels)


def _solutions(v):
    """``p=5,q=2; p=7,q=2`` -> ``(5,2), (7,2)``: assignments that repeat their labels in one order are one tuple
    per solution (``x=1, x=2`` -> ``1, 2``). Anything else is returned as it is."""
    if not isinstance(v, Multi) or not all(isinstance(x, Rel) and x.ops == ["="] and _is_label(x.parts[0])
                                           for x in v.items):
        return v
    labels = [str(x.parts[0]) for x in v.items]
    k = labels.index(labels[0], 1) if labels.count(labels[0]) > 1 else len(labels)
    if k == len(labels) or len(labels) % k or len(set(labels[:k])) != k or labels != labels[:k] * (len(labels) // k):
        return v
    values = [x.parts[1] for x in v.items]
    if k == 1:
        return Multi(values)
    return Multi([Tup(values[i:i + k], "(", ")") for i in range(0, len(values), k)])


def _unordered(xs, ys, dec, members: bool = False) -> bool:
    """The same items in any order; ``members``: items of two sets, where ``{1}`` is not ``1``."""
    if len(xs) != len(ys) or len(xs) > MAX_ITEMS:
        return False
    left = list(ys)
    for x in xs:
        for k, y in enumerate(left):
            if (not members or isinstance(x, SetV) == isinstance(y, SetV)) and values_equiv(x, y, dec):
                del left[k]
                break
        else:
            return False
    return True


def _ordered(xs, ys, dec) -> bool:
    return (len(xs) == len(ys) <= MAX_ITEMS
            and all(values_equiv(x, y, dec) for x, y in zip(xs, ys)))


def _dedupe_set(items, dec):
    out = []
    for x in items:
        if not any(values_equiv(x, y, dec) for y in out):
            out.append(x)
    return out


def _vector(m: Matrix):
    if len(m.rows) == 1:
        return m.rows[0]
    if all(len(r) == 1 for r in m.rows):
        return [r[0] for r in m.rows]
    return None


def values_equiv(a, b, dec: bool) -> bool:
    """Equivalence of two parsed answer values (answer ``a``, reference ``b``)."""
    if isinstance(a, _Text) or isinstance(b, _Text):
        return isinstance(a, _Text) and isinstance(b, _Text) and a.s == b.s
    a, b = _solutions(a), _solutions(b)
    if isinstance(a, Rel) and a.ops == ["in"] and isinstance(b, Rel):  # z \in [..] U [..] vs 1 <= |z| <= 5
        va = _rel_value(a)
        return va is not None and values_equiv(va, b, dec)
    if isinstance(b, Rel) and b.ops == ["in"] and isinstance(a, Rel):
        vb = _rel_value(b)
        return vb is not None and values_equiv(a, vb, dec)
    if isinstance(a, Multi) or isinstance(b, Multi):
        if isinstance(a, Multi) and isinstance(b, Multi):
            if _labelled_assignment(a) != _labelled_assignment(b):  # 6, 7 vs PQ=6, RS=7
                return _ordered(a.items, b.items, dec)
            return _unordered(_dedupe_set(a.items, dec), _dedupe_set(b.items, dec), dec)  # a solution listed twice
        other = b if isinstance(a, Multi) else a
        multi = a if isinstance(a, Multi) else b
        if (not isinstance(other, (SetV, Tup, UnionV)) and len(multi.items) <= MAX_ITEMS
                and all(values_equiv(x, multi.items[0], dec) for x in multi.items[1:])):
            return values_equiv(multi.items[0], other, dec)  # "1/2 or 0.5": one value written twice
        if isinstance(other, UnionV):  # x < -1 or x > 3  vs  (-oo,-1) U (3,oo)
            ivs = [_interval(x) if isinstance(x, Rel) else x for x in multi.items]
            return None not in ivs and _unordered(ivs, other.parts, dec)
        if isinstance(other, SetV):
            return _unordered(_dedupe_set(multi.items, dec), _dedupe_set(other.items, dec), dec)
        if isinstance(other, Tup) and other.left == "(" and other.right == ")":
            return _ordered(multi.items, other.items, dec)
        return False
    if isinstance(a, Rel) or isinstance(b, Rel):
        if isinstance(a, Rel) and isinstance(b, Rel):
            return _rel_equiv(a, b, dec)
        if isinstance(a, Rel):
            if isinstance(b, (Tup, UnionV)) and _is_ineq(a):
                ia = _interval(a)
                return ia is not None and values_equiv(ia, b, dec)
            va = _rel_value(a)
            return va is not None and values_equiv(va, b, dec)
        if isinstance(a, (Tup, UnionV)) and _is_ineq(b):
            ib = _interval(b)
            return ib is not None and values_equiv(a, ib, dec)
        vb = _rel_value(b)
        return vb is not None and values_equiv(a, vb, dec)
    if isinstance(a, BraceSet) and isinstance(b, Tup) and (b.left, b.right) == ("(", ")"):
        return _ordered(a.items, b.items, dec)  # the answer ${1,3}$ renders as 1,3: the pair in its order
    if isinstance(a, Tup) and isinstance(b, Tup):
        return a.left == b.left and a.right == b.right and _ordered(a.items, b.items, dec)
    if isinstance(a, SetV) and isinstance(b, SetV):
        return _unordered(_dedupe_set(a.items, dec), _dedupe_set(b.items, dec), dec, members=True)
    if isinstance(a, SetV) != isinstance(b, SetV):  # {2} vs 2
        st, other = (a, b) if isinstance(a, SetV) else (b, a)
        return len(st.items) == 1 and isinstance(other, sympy.Expr) and values_equiv(st.items[0], other, dec)
    if isinstance(a, UnionV) or isinstance(b, UnionV):
        pa = a.parts if isinstance(a, UnionV) else [a]
        pb = b.parts if isinstance(b, UnionV) else [b]
        return _unordered(pa, pb, dec)
    if isinstance(a, Matrix) and isinstance(b, Matrix):
        return (len(a.rows) == len(b.rows) and len(a.rows[0]) == len(b.rows[0])
                and all(_ordered(ra, rb, dec) for ra, rb in zip(a.rows, b.rows)))
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        m, t = (a, b) if isinstance(a, Matrix) else (b, a)
        vec = _vector(m)
        if vec is not None and isinstance(t, Tup) and t.left == "(" and t.right == ")":
            return _ordered(vec, t.items, dec)
        return False
    if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr):
        return expr_equiv(a, b, dec)
    return False


_LETTER_RE = re.compile(r"\(\s*([A-Z])\s*\)|(?<![A-Za-z\\])([A-HJ-Z])(?![A-Za-z])")


def _choice(cleaned: str):
    """The option letter of a multiple-choice reference: ``C``, ``(C)``; else None."""
    m = _CHOICE_RE.fullmatch(cleaned)
    return m.group(1) if m else None


def _choice_letters(cleaned: str) -> set:
    """Every option letter an answer names: ``(C)``, ``C.``, ``C`` (a lone capital)."""
    return {m.group(1) or m.group(2) for m in _LETTER_RE.finditer(cleaned)}


_CHOICE_VALUE_RE = re.compile(r"\(\s*([A-Z])\s*\)\s*(\S.*)")
_DEC_COMMA_RE = re.compile(r"-?\d+,\d+")


def _decimal_comma(s: str, other: str) -> str:
    """``3,5`` -> ``3.5`` when the other side is a single value (no comma at all)."""
    if "," not in other and _DEC_COMMA_RE.fullmatch(s):
        return s.replace(",", ".")
    return s


def _plain_number(s: str):
    if _PLAIN_NUM_RE.fullmatch(s):
        return Fraction(s)
    return None


_DENY_WORDS_RE = re.compile(r"(?i)\b(?:not|no|wrong|incorrect|false|never|isn't)\b")
_RATIO_LABEL_RE = re.compile(  # V_1:V_2 = 11:21, AB:BC = 2:7 (a label of letters, subscripts allowed)
    r"(?:\\[A-Za-z]+\s*)?[A-Za-z]{1,4}(?:_\{?\w{1,6}\}?)?(?:\s*:\s*(?:\\[A-Za-z]+\s*)?[A-Za-z]{1,4}(?:_\{?\w{1,6}\}?)?)+"
    r"\s*=\s*([^=]*\d[^=]*)")


def _ratio_value(s: str) -> str:
    """A labelled ratio's value: ``S_1:S_2 = 7:32`` -> ``7:32`` (the parser has no ':', so the label stays else)."""
    m = _RATIO_LABEL_RE.fullmatch(s)
    return m.group(1).strip() if m else s


_CTRL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@lru_cache(maxsize=8192)
def is_equivalent(answer: str, reference: str) -> bool:
    """True when the answer string is mathematically equivalent to the reference string."""
    try:
        return _is_equivalent(answer, reference)
    except (ArithmeticError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError):
        return False


def _is_equivalent(answer: str, reference: str) -> bool:
    if len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    if _CTRL_RE.search(answer) or _CTRL_RE.search(reference):
        return False
    a, r = clean_answer(answer), clean_answer(reference)
    if not a or not r:
        return False
    a, r = _decimal_comma(a, r), _decimal_comma(r, a)
    a, r = _ratio_value(a), _ratio_value(r)
    # fast path: two plain numbers
    fa, fr = _plain_number(a), _plain_number(r)
    if fa is not None and fr is not None:
        return fa == fr
    m = _CHOICE_VALUE_RE.fullmatch(r)
    if m:  # reference "(C) 12": the option, or its value
        letters = _choice_letters(a)
        if letters:
            return letters == {m.group(1)}
        return is_equivalent(answer, m.group(2))
    ref_choice = _choice(r)
    if ref_choice is not None and _DENY_WORDS_RE.search(a):
        return False  # "(C) is not correct": an option named and taken back
    if ref_choice is not None:
        letters = _choice_letters(a)
        if letters or not re.fullmatch(r"[A-Z]", r):  # a bare capital may also be a variable
            return letters == {ref_choice}
    ca, cr = _candidates(a), _candidates(r)
    if not cr and "=" in r:  # a reference chain is its last side; earlier sides may be outside the grammar
        last = r.rsplit("=", 1)[1]
        if last.strip() and last.count("{") == last.count("}") and last.count("(") == last.count(")"):
            cr = _candidates(last)
    for va, da in ca:
        for vr, dr in cr:
            if values_equiv(va, vr, da or dr):
                return True
    if not ca and not cr:  # both outside the grammar (e.g. "3:4"): same text, spaces aside
        return re.sub(r"\s+", "", a) == re.sub(r"\s+", "", r)
    return False


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference, else 0.0; never raises."""
    try:
        if not isinstance(completion, str) or not isinstance(reference, str):
            return 0.0
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        ref = _reference_answer(reference)
        if not ref:
            return 0.0
        parts, ordered = answer_group(normalize_unicode(end_of_turn(completion)))
        if ordered and parts:
            refs = split_top_level(ref)
            if len(refs) == len(parts):  # (a) ... (b) ...: part by part, in the reference's order
                return 1.0 if all(is_equivalent(p, q) for p, q in zip(parts, refs)) else 0.0
        return 1.0 if is_equivalent(answer, ref) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0


# A value written out: a number, or a fraction of two integers (1/2, \frac{1}{2}), with an optional sign.
_WRITTEN_VALUE_RE = re.compile(r"-?\s*(?:\d+(?:\.\d+)?|\d+\s*/\s*\d+|\\frac\{\s*\d+\s*\}\{\s*\d+\s*\})")


def evaluated_math_reward(completion: str, reference: str) -> float:
    """math_reward for tasks whose question is itself the arithmetic ("What is 35+20?"), when the reference is a
    number: the final answer (the last side of a chain "a = b = c") must be that number written out. math_reward
    grades "35+20" and "35+20=N" equal to 55, as it should for a derivation or a labelled answer (math-verify does
    the same), but here that pays for restating the question: SmolLM2-135M learned both within 8 GRPO steps. A
    chain that ends in the value ("35+20=55") still counts. Other references are graded as math_reward does.
    Never raises."""
    try:
        if not isinstance(completion, str) or not isinstance(reference, str):
            return 0.0
        answer, ref = extract_answer(completion), _reference_answer(reference)
        if answer is None or not ref:
            return 0.0
        last_side = clean_answer(answer).split("=")[-1].strip()
        if _WRITTEN_VALUE_RE.fullmatch(clean_answer(ref)) and not _WRITTEN_VALUE_RE.fullmatch(last_side):
            return 0.0
        return 1.0 if is_equivalent(answer, ref) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0

"""Math answer extraction and equivalence grading for RLVR rewards.

Public API
----------
``extract_answer(text) -> str | None``
    The final answer of a completion: the content of the last ``\\boxed{...}`` /
    ``\\fbox{...}`` (nested braces), else the last GSM8K ``#### n`` line, else the
    last "the final answer is ..." phrase; ``None`` when there is none.

``math_reward(completion, reference) -> float``
    1.0 when the extracted answer is mathematically equivalent to the reference,
    else 0.0.  Never raises.

How equivalence is decided
--------------------------
Both sides are cleaned (``$``, ``\\left``/``\\right``, spacing macros, ``\\text``
units, degrees, thousands separators, a trailing period ...) and parsed by the
restricted parser in :mod:`grpo_dist.rewards.parser` (no ``eval``/``sympify``).
Then:

* plain numbers are compared as exact fractions;
* constant expressions are compared exactly (sympy's automatic simplification)
  and, failing that, numerically at 50 significant digits with a relative
  tolerance of 1e-20 (two different closed forms of one number, e.g.
  ``\\sqrt{8}`` and ``2\\sqrt2``);
* expressions with variables are compared by evaluating both at several fixed
  generic points (a randomised identity test; no ``simplify``, so it is bounded);
* equations compare their right-hand sides when the left side is the same
  variable (``x = 5`` vs ``5``), else ``lhs - rhs`` up to a constant factor;
* tuples and intervals are ordered and their brackets must match; sets, unions
  and top-level comma lists are unordered; matrices compare element-wise;
* percent answers match both ``p`` and ``p/100``; multiple-choice letters match
  ``(B)``, ``\\text{(B)}`` and ``B``; text answers compare case-insensitively.

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
from fractions import Fraction
from functools import lru_cache

import mpmath
import sympy

from grpo_dist.rewards.parser import (
    MAX_ANSWER_CHARS, EVAL_DPS, EvalError, Matrix, Multi, ParseError, Rel, SetV, Tup, UnionV,
    mp_eval, parse,
)

__all__ = ["extract_answer", "math_reward", "is_equivalent", "clean_answer",
           "DECIMAL_REL_TOL"]

DECIMAL_REL_TOL = 1e-4     # decimal vs. non-terminating exact value
EXACT_REL_TOL = 1e-20      # two exact closed forms, compared at 50 digits
POINT_REL_TOL = 1e-12      # expressions with variables, at generic points
MAX_ITEMS = 64             # answers in a list / set / tuple / matrix

# --------------------------------------------------------------------------- extraction
_BOX_NAMES = ("\\boxed", "\\fbox")
_CTRL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _brace_content(text: str, start: int):
    """Content of the brace group opening at text[start] == '{' (or None)."""
    depth = 0
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str):
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces), or of `\\boxed 5`; None if absent."""
    positions = []
    for name in _BOX_NAMES:
        end = len(text)
        for _ in range(3):  # the last few occurrences of each name
            p = text.rfind(name, 0, end)
            if p < 0:
                break
            positions.append((p, name))
            end = p
    for p, name in sorted(positions, reverse=True)[:3]:
        j = p + len(name)
        if j < len(text) and text[j].isalpha():  # \boxedfoo is another macro
            continue
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            content = _brace_content(text, j)
            if content is not None:
                return content
        elif j > p + len(name):  # "\boxed 5"
            m = re.match(r"[^\s$]+", text[j:j + 200])
            if m:
                return m.group(0)
    return None


_FINAL_RE = re.compile(r"final answer\s*(?:is|:)\s*:?\s*", re.I)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None (see module docstring)."""
    if not isinstance(text, str) or not text:
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    p = text.rfind("####")
    if p >= 0:
        line = text[p + 4:].split("\n", 1)[0].strip()
        if line:
            return line
    low = text.lower()
    p = low.rfind("final answer")
    while p >= 0:
        m = _FINAL_RE.match(text, p)
        if m:
            rest = text[m.end():m.end() + MAX_ANSWER_CHARS + 10]
            ans = _phrase_answer(rest)
            if ans:
                return ans
        p = low.rfind("final answer", 0, p)
    return None


def _phrase_answer(rest: str):
    rest = rest.split("\n", 1)[0].strip()
    if rest.startswith("$"):
        body = rest.lstrip("$")
        q = body.find("$")
        if q >= 0:
            return body[:q].strip() or None
    m = re.match(r"(.*?)(?:\.\s|\.$|$)", rest)
    ans = m.group(1).strip() if m else rest
    return ans.strip("$ ") or None


def _reference_answer(reference: str) -> str:
    if "\\boxed" in reference or "\\fbox" in reference:
        b = last_boxed(reference)
        if b is not None:
            return b.strip()
    p = reference.rfind("####")
    if p >= 0:
        return reference[p + 4:].strip()
    return reference.strip()


# --------------------------------------------------------------------------- cleaning
_UNICODE = [
    ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "*"), ("\u22c5", "*"), ("\u00b7", "*"),
    ("\u00f7", "/"), ("\u03c0", "\\pi "), ("\u221e", "\\infty "), ("\u221a", "\\sqrt"),
    ("\u2264", "\\le "), ("\u2265", "\\ge "), ("\u2260", "\\ne "), ("\u00b0", ""),
    ("\u222a", "\\cup "), ("\u00a0", " "), ("\u2009", " "), ("\u202f", " "),
]
_WRAPPERS = (r"(?:text|textbf|textit|textrm|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|mathtt|boldsymbol|bm|"
             r"operatorname|emph|hbox)")
_UNIT_WORDS = (
    "cm|mm|km|m|meters?|metres?|centimeters?|millimeters?|kilometers?|inch|inches|in|feet|foot|ft|"
    "yards?|yd|miles?|mi|units?|square units|sq units|degrees?|deg|radians?|rad|cents?|dollars?|"
    "hours?|hrs?|h|minutes?|mins?|seconds?|secs?|s|days?|weeks?|months?|years?|kg|g|grams?|"
    "kilograms?|pounds?|lbs?|oz|ounces?|liters?|litres?|l|ml|gallons?|mph|km/h|m/s|percent|"
    "people|students|apples|times|ways|points|marbles|books|pages|cookies|pieces"
)
_UNIT_TAIL_RE = re.compile(
    r"(?<=[\d}.])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:" + _UNIT_WORDS + r")(?:\s*\^\s*\{?\s*[23]\s*\}?|[23])?\s*$",
    re.I,
)
_TEXT_UNIT_RE = re.compile(
    r"(?<=[\d}).])\s*\\" + _WRAPPERS + r"\s*\{\s*(?:[A-Za-z][A-Za-z .]+|[mgsLh])\s*\}(?:\s*\^\s*\{?\s*[23]\s*\}?)?"
)
_TEXT_CONNECT_RE = re.compile(r"\\" + _WRAPPERS + r"\s*\{\s*(?:and|or|,)\s*\}")
_UNWRAP_RE = re.compile(r"\\" + _WRAPPERS + r"\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])(?!\.\d*,)")


def _strip_thousands(s: str) -> str:
    out, last = [], 0
    for m in _THOUSANDS_RE.finditer(s):
        prefix = s[:m.start()]
        depth = sum(prefix.count(c) for c in "([") - sum(prefix.count(c) for c in ")]")
        depth += prefix.count("\\{") - prefix.count("\\}")
        if depth > 0:
            continue
        out.append(s[last:m.start()])
        out.append(m.group(0).replace(",", ""))
        last = m.end()
    out.append(s[last:])
    return "".join(out)


def clean_answer(s: str) -> str:
    """Strip LaTeX noise, units, degrees and separators from an answer string."""
    for a, b in _UNICODE:
        if a in s:
            s = s.replace(a, b)
    s = s.replace("\\$", " ").replace("$", " ")
    s = re.sub(r"\\[\[\]()]", " ", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg|displaystyle|textstyle)(?![A-Za-z])", "", s)
    s = s.replace("\\\\", "\x01")  # protect LaTeX row separators
    s = s.replace("{,}", ",")
    s = re.sub(r",\\!\s*", ",", s)
    s = re.sub(r"\\[,;:!]", "", s)
    s = re.sub(r"\\ |\\q?quad(?![A-Za-z])|~", " ", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = s.replace("\\%", "%")
    s = _TEXT_CONNECT_RE.sub(",", s)
    s = _TEXT_UNIT_RE.sub("", s)
    for _ in range(3):
        s2 = _UNWRAP_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    s = s.strip()
    s = re.sub(r"[.\s]+$", "", s) if not re.search(r"\d\.$", s) else s[:-1]
    s = re.sub(r"^[A-Za-z]\s*\\in\s*", "", s)
    s = re.sub(r"\s+(?:and|or)\s+", ",", s)
    s = _UNIT_TAIL_RE.sub("", s).strip()
    s = re.sub(r"\s*(?:degrees?|percent)$", "", s)
    s = _strip_thousands(s)
    s = s.replace("\x01", "\\\\")
    m = re.fullmatch(r"(-?\d+)\s+(\d+)\s*/\s*(\d+)", s)  # "1 1/2"
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"
    return s.strip()


# --------------------------------------------------------------------------- parsing
_PLAIN_NUM_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_CHOICE_RE = re.compile(r"\(?\s*([A-Z])\s*\)?")
_CHOICE_LOOSE_RE = re.compile(r"\(\s*([A-Z])\s*\)|([A-Z])(?=$|[.):]\s*)")
_MATH_WORDS = {"sqrt", "pi", "sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp",
               "infty", "infinity", "inf", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh"}


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
    return any(len(w) >= 3 and w.lower() not in _MATH_WORDS for w in words)


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


def _ratio_const(d1, d2) -> bool:
    """d1 == c * d2 for a nonzero constant c (equations written differently)."""
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
    return good >= 2


_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!="}


def _rel_value(r: Rel):
    """``x = 5`` -> 5, ``x \\in [1,2]`` -> [1,2], ``x = 2+3 = 5`` -> 5; else None."""
    if all(op in ("=", "in") for op in r.ops):
        if isinstance(r.parts[0], sympy.Symbol):
            return r.parts[-1]
        if len(r.parts) == 2 and isinstance(r.parts[1], sympy.Symbol) and r.ops[0] == "=":
            return r.parts[0]
    return None


def _rel_equiv(a: Rel, b: Rel, dec: bool) -> bool:
    if len(a.parts) != 2 or len(b.parts) != 2:
        return False
    (al, ar), (bl, br) = a.parts, b.parts
    aop, bop = a.ops[0], b.ops[0]
    if aop in ("<", "<="):
        al, ar, aop = ar, al, _FLIP[aop]
    if bop in ("<", "<="):
        bl, br, bop = br, bl, _FLIP[bop]
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


def _unordered(xs, ys, dec) -> bool:
    if len(xs) != len(ys) or len(xs) > MAX_ITEMS:
        return False
    left = list(ys)
    for x in xs:
        for k, y in enumerate(left):
            if values_equiv(x, y, dec):
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
    if isinstance(a, Multi) or isinstance(b, Multi):
        if isinstance(a, Multi) and isinstance(b, Multi):
            return _unordered(a.items, b.items, dec)
        other = b if isinstance(a, Multi) else a
        multi = a if isinstance(a, Multi) else b
        if isinstance(other, SetV):
            return _unordered(_dedupe_set(multi.items, dec), _dedupe_set(other.items, dec), dec)
        if isinstance(other, Tup) and other.left == "(" and other.right == ")":
            return _ordered(multi.items, other.items, dec)
        return False
    if isinstance(a, Rel) or isinstance(b, Rel):
        if isinstance(a, Rel) and isinstance(b, Rel):
            return _rel_equiv(a, b, dec)
        if isinstance(a, Rel):
            va = _rel_value(a)
            return va is not None and values_equiv(va, b, dec)
        vb = _rel_value(b)
        return vb is not None and values_equiv(a, vb, dec)
    if isinstance(a, Tup) and isinstance(b, Tup):
        return a.left == b.left and a.right == b.right and _ordered(a.items, b.items, dec)
    if isinstance(a, SetV) and isinstance(b, SetV):
        return _unordered(_dedupe_set(a.items, dec), _dedupe_set(b.items, dec), dec)
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


def _choice(cleaned: str, loose: bool):
    m = _CHOICE_RE.fullmatch(cleaned)
    if m:
        return m.group(1)
    if loose:
        m = _CHOICE_LOOSE_RE.match(cleaned)
        if m:
            return m.group(1) or m.group(2)
    return None


def _plain_number(s: str):
    if _PLAIN_NUM_RE.fullmatch(s):
        return Fraction(s)
    return None


@lru_cache(maxsize=8192)
def is_equivalent(answer: str, reference: str) -> bool:
    """True when the answer string is mathematically equivalent to the reference string."""
    if len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    if _CTRL_RE.search(answer) or _CTRL_RE.search(reference):
        return False
    a, r = clean_answer(answer), clean_answer(reference)
    if not a or not r:
        return False
    # fast path: two plain numbers
    fa, fr = _plain_number(a), _plain_number(r)
    if fa is not None and fr is not None:
        return fa == fr
    ref_choice = _choice(r, loose=False)
    if ref_choice is not None and not re.fullmatch(r"[A-Z]", r):
        ans_choice = _choice(a, loose=True)
        return ans_choice == ref_choice
    if ref_choice is not None:  # a bare capital letter: a choice or a variable
        ans_choice = _choice(a, loose=True)
        if ans_choice is not None:
            return ans_choice == ref_choice
    ca, cr = _candidates(a), _candidates(r)
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
        return 1.0 if is_equivalent(answer, ref) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0

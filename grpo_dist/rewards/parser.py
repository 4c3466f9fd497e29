"""A small, restricted parser for the math found in final answers.

Model text is never handed to ``eval``, ``sympify`` or ``parse_expr``.  Instead a
hand-written tokenizer and recursive-descent parser accept a fixed subset of
LaTeX / plain-text math and build sympy objects directly from a whitelist
(integers, rationals, symbols, +, -, *, /, powers, roots, pi, e, i, infinity,
a few elementary functions, factorial, binomial).  Anything else raises
:class:`ParseError`.

Every operation that could make sympy do unbounded work is checked *before* it
is built: input length, token count, nesting depth, the size of the numbers a
power, factorial or binomial would produce, and the size of exponents on
symbols.  So parsing and the later numeric comparison stay within a few
milliseconds even for hostile input.

Besides plain expressions the parser returns small container values: ordered
tuples / intervals (:class:`Tup`), sets (:class:`SetV`), unions of intervals
(:class:`UnionV`), relations such as ``x = 5`` (:class:`Rel`), matrices
(:class:`Matrix`) and comma-separated answer lists (:class:`Multi`).
"""
from __future__ import annotations

import math
import re

import mpmath
import sympy

from grpo_dist.rewards.extract import MAX_ANSWER_CHARS

__all__ = [
    "ParseError", "parse", "Tup", "SetV", "BraceSet", "UnionV", "Rel", "Matrix", "Multi", "PMList",
    "MAX_DEPTH", "MAX_BITS",
]

MAX_TOKENS = 1000         # longest token stream
MAX_NESTING = 48          # deepest bracket nesting in the text
MAX_DEPTH = 160           # deepest recursion of the parser (about 3 per bracket level)
MAX_BITS = 1 << 17        # largest exact number a power may produce (~39,500 digits, 2^65536 fits)
MAX_SYMBOLIC_EXP = 1000   # |n| in x^n when x is symbolic
MAX_FACTORIAL = 1000      # n! only for 0 <= n <= 1000
MAX_BINOM = 2000          # binomial(n, k) only for n <= 2000
MAX_ROOT_INDEX = 1000     # q in x^(p/q)
MAX_ALTERNATIVES = 8      # how many answers a chain of \pm may expand to
MAX_SCI_EXP = 1000        # |k| in 1.5e<k>


class ParseError(ValueError):
    """The text is outside the accepted grammar or over a resource bound."""


# --------------------------------------------------------------------------- values
class Tup:
    """Bracketed, ordered sequence: a tuple / point or an interval."""

    __slots__ = ("items", "left", "right")

    def __init__(self, items, left, right):
        self.items, self.left, self.right = list(items), left, right

    def __repr__(self):
        return f"Tup({self.left}{self.items}{self.right})"


class SetV:
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = list(items)

    def __repr__(self):
        return f"SetV({self.items})"


class BraceSet(SetV):
    """A list in bare braces, ``{2, 5}``: a set, unless the reference is an ordered tuple -- then it is the TeX
    group LaTeX renders it as, the list 2, 5 in its written order (``{5, 2}`` is not ``(2, 5)``)."""

    __slots__ = ()

    def __repr__(self):
        return f"BraceSet({self.items})"


class UnionV:
    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = list(parts)

    def __repr__(self):
        return f"UnionV({self.parts})"


class Rel:
    """A chain ``parts[0] ops[0] parts[1] ...`` with ops in =, <, >, <=, >=, !=, in."""

    __slots__ = ("ops", "parts")

    def __init__(self, ops, parts):
        self.ops, self.parts = list(ops), list(parts)

    def __repr__(self):
        return f"Rel({self.parts!r}, {self.ops!r})"


class Matrix:
    __slots__ = ("rows",)

    def __init__(self, rows):
        self.rows = [list(r) for r in rows]

    def __repr__(self):
        return f"Matrix({self.rows})"


class Multi:
    """Several answers separated by commas at top level (order does not matter)."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = list(items)

    def __repr__(self):
        return f"Multi({self.items})"


class PMList:
    """The alternatives produced by ``\\pm`` / ``\\mp``."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = list(items)

    def __repr__(self):
        return f"PMList({self.items})"


# --------------------------------------------------------------------------- tokens
_TOKEN_RE = re.compile(
    r"""
     (?P<ws>\s+)
    |(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,6}(?![A-Za-z0-9]))?)
    |(?P<begin>\\begin\s*\{\s*(?P<benv>[A-Za-z]+\*?)\s*\})
    |(?P<end>\\end\s*\{\s*(?P<eenv>[A-Za-z]+\*?)\s*\})
    |(?P<cmd>\\[A-Za-z]+)
    |(?P<rowsep>\\\\)
    |(?P<esc>\\[{}|,;:!\ %$])
    |(?P<word>[A-Za-z]+)
    |(?P<op>\*\*|!=|<=|>=|[-+*/^_()\[\]{},=|!<>;&%])
    """,
    re.X | re.ASCII,
)

_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot,
    "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh,
    "ln": sympy.log, "log": sympy.log, "exp": sympy.exp,
}
_INVERSE = {"sin": sympy.asin, "cos": sympy.acos, "tan": sympy.atan}
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau",
    "upsilon", "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta",
    "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega",
}
# plain-text words understood inside a letter run (longest first)
_WORDS = sorted(
    ["sqrt", "pi", "infty", "infinity", "inf", "oo", "arcsin", "arccos", "arctan",
     "sinh", "cosh", "tanh", "sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp"],
    key=len, reverse=True,
)
_SKIP_CMDS = {
    "left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr",
    "displaystyle", "textstyle", "limits", "quad", "qquad", "hfill", "angle", "measuredangle", "triangle",
}
_CMD_ALIAS = {
    "cdot": ("op", "*"), "times": ("op", "*"), "ast": ("op", "*"), "div": ("op", "/"),
    "lvert": ("op", "|"), "rvert": ("op", "|"), "vert": ("op", "|"), "mid": ("op", "|"),
    "lbrace": ("setopen", "{"), "rbrace": ("setclose", "}"),
    "langle": ("op", "("), "rangle": ("op", ")"),
    "le": ("rel", "<="), "leq": ("rel", "<="), "leqslant": ("rel", "<="),
    "ge": ("rel", ">="), "geq": ("rel", ">="), "geqslant": ("rel", ">="),
    "lt": ("rel", "<"), "gt": ("rel", ">"), "ne": ("rel", "!="), "neq": ("rel", "!="),
    "approx": ("rel", "approx"), "simeq": ("rel", "approx"), "equiv": ("rel", "="), "in": ("rel", "in"),
    "dfrac": ("cmd", "frac"), "tfrac": ("cmd", "frac"), "cfrac": ("cmd", "frac"),
    "dbinom": ("cmd", "binom"), "tbinom": ("cmd", "binom"),
    "infty": ("cmd", "infty"), "varnothing": ("cmd", "emptyset"),
    "arcsec": ("cmd", "unknown"),
}


def tokenize(s: str) -> list:
    toks = []
    pos, n = 0, len(s)
    while pos < n:
        m = _TOKEN_RE.match(s, pos)
        if m is None:
            raise ParseError(f"unexpected character {s[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind in ("benv", "eenv"):  # pragma: no cover - lastgroup is the outer group
            kind = "begin" if kind == "benv" else "end"
        text = m.group(0)
        if kind == "ws":
            continue
        if kind == "num":
            toks.append(("num", text))
        elif kind == "begin":
            toks.append(("begin", m.group("benv").rstrip("*")))
        elif kind == "end":
            toks.append(("end", m.group("eenv").rstrip("*")))
        elif kind == "rowsep":
            toks.append(("rowsep", "\\\\"))
        elif kind == "esc":
            c = text[1]
            if c == "{":
                toks.append(("setopen", "{"))
            elif c == "}":
                toks.append(("setclose", "}"))
            elif c == "|":
                toks.append(("op", "|"))
            elif c == "%":
                toks.append(("op", "%"))
            # \, \; \: \! \  \$ are spacing / noise
        elif kind == "cmd":
            name = text[1:]
            if name in _SKIP_CMDS:
                continue
            if name in _CMD_ALIAS:
                toks.append(_CMD_ALIAS[name])
            else:
                toks.append(("cmd", name))
        elif kind == "word":
            _split_word(text, toks)
        else:  # op
            if text == "**":
                toks.append(("op", "^"))
            elif text in ("!=", "<=", ">=", "<", ">"):
                toks.append(("rel", text))
            elif text == "=":
                toks.append(("rel", "="))
            else:
                toks.append(("op", text))
        if len(toks) > MAX_TOKENS:
            raise ParseError("too many tokens")
    return toks


def _split_word(word: str, toks: list) -> None:
    i = 0
    while i < len(word):
        for w in _WORDS:
            if word.startswith(w, i):
                name = {"infinity": "infty", "inf": "infty", "oo": "infty"}.get(w, w)
                toks.append(("cmd", name))
                i += len(w)
                break
        else:
            toks.append(("id", word[i]))
            i += 1


# --------------------------------------------------------------------------- guards
MAX_MATRIX_PRODUCT = 512   # multiplications in one matrix product (8x8 times 8x8)


def _shape(m) -> tuple:
    return len(m.rows), len(m.rows[0])


def _matrix_product(a, b):
    """A product with a matrix: a scalar times a matrix, or two matrices whose inner sizes agree."""
    if not isinstance(a, Matrix):
        a, b = b, a  # a scalar commutes with a matrix
    if not isinstance(b, Matrix):
        return Matrix([[_check_size(_check_finite(x * _expr(b))) for x in r] for r in a.rows])
    (n, k), (k2, m) = _shape(a), _shape(b)
    if k != k2:
        raise ParseError("matrix product of mismatched shapes")
    if n * k * m > MAX_MATRIX_PRODUCT:  # bounded work: the grader never multiplies large matrices
        raise ParseError("matrix product too large")
    return Matrix([[_check_size(_check_finite(sympy.Add(*[a.rows[i][j] * b.rows[j][c] for j in range(k)])))
                    for c in range(m)] for i in range(n)])


def _is_expr(v) -> bool:
    return isinstance(v, sympy.Expr)


def _expr(v):
    if not isinstance(v, sympy.Expr):
        raise ParseError("arithmetic on a non-expression")
    return v


def _check_finite(v):
    if v.has(sympy.zoo, sympy.nan):
        raise ParseError("undefined value")
    return v


def _bits_of_rational(r) -> int:
    return max(int(r.p).bit_length(), int(r.q).bit_length())


def _magnitude_log2(v) -> float:
    """|log2 |v|| for a numeric sympy expression, estimated cheaply and safely."""
    if v.is_Rational:
        if v == 0:
            return 0.0
        return float(_bits_of_rational(v))
    try:
        f = mp_eval(v)
    except (EvalError, ZeroDivisionError, ValueError, TypeError):
        raise ParseError("cannot size number") from None
    a = abs(f)
    if a == 0:
        return 0.0
    return float(abs(mpmath.log(a, 2)))


def guarded_pow(b, e):
    b, e = _expr(b), _expr(e)
    if e.is_number:
        if e.is_Number:
            fe = abs(float(e)) if e.is_finite else math.inf
            if e.is_Rational and not e.is_Integer and e.q > MAX_ROOT_INDEX:
                raise ParseError("root index too large")
        else:
            try:
                fe = float(abs(mp_eval(e)))
            except (EvalError, ZeroDivisionError, ValueError, TypeError):
                raise ParseError("cannot size exponent") from None
        if not math.isfinite(fe):
            raise ParseError("infinite exponent")
        if b.free_symbols:
            if fe > MAX_SYMBOLIC_EXP:
                raise ParseError("exponent too large")
        elif not (b == 0 or b == 1 or b == -1):
            lb = _magnitude_log2(b)
            if lb < 1e-12:  # |b| == 1 but b not +-1 (e.g. i): only modest exponents
                if fe > 10 ** 6:
                    raise ParseError("exponent too large")
            elif fe * lb > MAX_BITS:
                raise ParseError("power too large")
    else:
        if b.is_number and b.is_Number and not (b == 0 or b == 1 or b == -1):
            pass  # symbolic exponent: stays unevaluated
    return _check_finite(sympy.Pow(b, e))


def guarded_factorial(v):
    v = _expr(v)
    if v.is_number:
        if not (v.is_Integer and 0 <= v <= MAX_FACTORIAL):
            raise ParseError("factorial argument out of range")
        return sympy.factorial(v)
    return sympy.factorial(v)


def guarded_binomial(n, k):
    n, k = _expr(n), _expr(k)
    for x in (n, k):
        if x.is_number and not (x.is_Integer and abs(x) <= MAX_BINOM):
            raise ParseError("binomial argument out of range")
    if not (n.is_number and k.is_number):
        raise ParseError("symbolic binomial")
    return sympy.binomial(n, k)


def _check_size(v):
    """Reject exact numbers that grew too big through products."""
    if v.is_Rational and _bits_of_rational(v) > 2 * MAX_BITS:
        raise ParseError("number too large")
    return v


def _number(text: str):
    mant, _, exp = text.lower().partition("e")
    if mant.endswith("."):
        mant = mant[:-1]
    if mant.startswith("."):
        mant = "0" + mant
    if "." in mant:
        ip, fp = mant.split(".")
        val = sympy.Rational(int(ip + fp), 10 ** len(fp))
    else:
        val = sympy.Integer(int(mant))
    if exp:
        k = int(exp)
        if abs(k) > MAX_SCI_EXP:
            raise ParseError("exponent too large")
        val = val * sympy.Rational(10) ** k
    return val


# --------------------------------------------------------------------------- parser
_MATRIX_ENVS = {"pmatrix", "bmatrix", "Bmatrix", "matrix", "smallmatrix", "array", "vmatrix"}


class _Parser:
    def __init__(self, tokens, percent_div: bool):
        self.t = tokens
        self.i = 0
        self.depth = 0
        self.abs_depth = 0
        self.percent_div = percent_div
        self.has_decimal = False

    # -- helpers
    def peek(self, k=0):
        j = self.i + k
        return self.t[j] if j < len(self.t) else ("eof", "")

    def take(self):
        tok = self.peek()
        self.i += 1
        return tok

    def accept(self, kind, val=None):
        tok = self.peek()
        if tok[0] == kind and (val is None or tok[1] == val):
            self.i += 1
            return True
        return False

    def expect(self, kind, val=None):
        if not self.accept(kind, val):
            raise ParseError(f"expected {val or kind}, got {self.peek()[1]!r}")

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError("nesting too deep")

    def leave(self):
        self.depth -= 1

    # -- grammar
    def parse_top(self):
        items = self.parse_seq()
        if self.peek()[0] != "eof":
            raise ParseError(f"unexpected {self.peek()[1]!r}")
        items = _flatten(items)
        return items[0] if len(items) == 1 else Multi(items)

    def parse_seq(self):
        items = [self.parse_item()]
        while self.accept("op", ",") or self.accept("op", ";"):
            items.append(self.parse_item())
        return items

    def parse_item(self):
        self.enter()
        try:
            parts = [self.parse_union()]
            ops = []
            while self.peek()[0] == "rel":
                ops.append(self.take()[1])
                parts.append(self.parse_union())
            if not ops:
                return parts[0]
            pm = [k for k, p in enumerate(parts) if isinstance(p, PMList)]
            if not pm:
                return Rel(ops, parts)
            if len(pm) > 1:
                raise ParseError("several \\pm in a relation")
            k = pm[0]
            return PMList([Rel(ops, parts[:k] + [alt] + parts[k + 1:]) for alt in parts[k].items])
        finally:
            self.leave()

    def parse_union(self):
        first = self.parse_additive()
        if not (self.peek() == ("cmd", "cup") or self.peek() == ("op", "U")):
            return first
        parts = [first]
        while self.accept("cmd", "cup"):
            parts.append(self.parse_additive())
        for p in parts:
            if not isinstance(p, (Tup, SetV, UnionV)):
                raise ParseError("union of non-sets")
        if all(isinstance(p, SetV) for p in parts):  # {1, 2} U {3} is the finite set {1, 2, 3}
            return SetV([x for p in parts for x in p.items])
        return UnionV(parts)

    def parse_additive(self):
        tok = self.peek()
        if tok == ("cmd", "pm") or tok == ("cmd", "mp"):
            self.take()
            t = _expr(self.parse_term())
            alts = [[t], [-t]]
        else:
            first = self.parse_term()
            if not self._add_op_next():
                return first
            if isinstance(first, Matrix):
                return self._matrix_sum(first)
            alts = [[_expr(first)]]
        while self._add_op_next():
            op = self.take()[1]
            t = _expr(self.parse_term())
            if op == "+":
                alts = [a + [t] for a in alts]
            elif op == "-":
                alts = [a + [-t] for a in alts]
            elif op == "pm":
                alts = [a + [t] for a in alts] + [a + [-t] for a in alts]
            else:  # mp
                alts = [a + [-t] for a in alts] + [a + [t] for a in alts]
            if len(alts) > MAX_ALTERNATIVES:
                raise ParseError("too many alternatives")
        alts = [_check_size(_check_finite(sympy.Add(*a))) for a in alts]
        return alts[0] if len(alts) == 1 else PMList(alts)

    def _add_op_next(self):
        tok = self.peek()
        return tok in (("op", "+"), ("op", "-"), ("cmd", "pm"), ("cmd", "mp"))

    def parse_term(self):
        start = self.i
        left = self.parse_signed()
        first_tokens = self.t[start:self.i]
        first = True
        while True:
            tok = self.peek()
            if tok == ("op", "*"):
                self.take()
                left = self._mul(left, self.parse_signed())
            elif tok == ("op", "/"):
                self.take()
                left = self._div(left, self.parse_signed())
            elif self._starts_atom(tok):
                if tok[0] == "num" and self.t[self.i - 1][0] == "num":
                    raise ParseError("two numbers side by side")  # "5 7" is not 35
                right = self.parse_power()
                if first and _is_mixed_number(first_tokens, tok, right):
                    left = left - right if first_tokens[0] == ("op", "-") else left + right
                else:
                    left = self._mul(left, right)
            else:
                break
            first = False
        return left

    def _matrix_sum(self, acc):
        """``A + B - C`` of matrices of one shape, entry by entry (a worked matrix sum is its value, as
        ``2+3`` is 5)."""
        while self._add_op_next():
            op = self.take()[1]
            if op not in ("+", "-"):
                raise ParseError("\\pm on matrices")
            t = self.parse_term()
            if not isinstance(t, Matrix) or _shape(t) != _shape(acc):
                raise ParseError("matrix sum of different shapes")
            sign = 1 if op == "+" else -1
            acc = Matrix([[_check_size(_check_finite(x + sign * y)) for x, y in zip(ra, rb)]
                          for ra, rb in zip(acc.rows, t.rows)])
        return acc

    def _mul(self, a, b):
        if isinstance(a, Matrix) or isinstance(b, Matrix):
            return _matrix_product(a, b)
        return _check_size(_check_finite(_expr(a) * _expr(b)))

    def _div(self, a, b):
        a, b = _expr(a), _expr(b)
        if b == 0:
            raise ParseError("division by zero")
        return _check_size(_check_finite(a / b))

    def _starts_atom(self, tok):
        kind, val = tok
        if kind in ("num", "id", "setopen", "begin"):
            return True
        if kind == "cmd":
            return val not in ("pm", "mp", "cup", "cap", "to", "unknown", "rfloor", "rceil")
        if kind == "op":
            if val == "|":
                return self.abs_depth == 0
            return val in ("(", "[", "{")
        return False

    def parse_signed(self):
        if self.accept("op", "-"):
            self.enter()
            try:
                return -_expr(self.parse_signed())
            finally:
                self.leave()
        if self.accept("op", "+"):
            return _expr(self.parse_signed())
        return self.parse_power()

    def parse_power(self):
        base = self.parse_postfix()
        if self.accept("op", "^"):
            e = self.parse_exponent()
            base = guarded_pow(base, e)
            base = self._postfix_ops(base)
        return base

    def parse_exponent(self):
        self.enter()
        try:
            tok = self.peek()
            if tok == ("op", "-"):
                self.take()
                return -_expr(self.parse_exponent())
            if tok == ("op", "+"):
                self.take()
                return self.parse_exponent()
            v = self.parse_postfix()
            if self.accept("op", "^"):  # right associative: a^b^c = a^(b^c)
                v = guarded_pow(v, self.parse_exponent())
            return v
        finally:
            self.leave()

    def parse_postfix(self):
        v = self.parse_atom()
        return self._postfix_ops(v)

    def _postfix_ops(self, v):
        while True:
            tok = self.peek()
            if tok == ("op", "!"):
                self.take()
                v = guarded_factorial(v)
            elif tok == ("op", "%"):
                self.take()
                v = _expr(v) / 100 if self.percent_div else _expr(v)
            elif tok == ("op", "_"):
                self.take()
                sub = self.parse_arg()
                if isinstance(v, sympy.Integer) and isinstance(sub, sympy.Integer) and 2 <= sub <= 36:
                    pass  # a numeral written in base `sub`: keep its digits
                elif isinstance(v, sympy.Symbol) and _is_expr(sub) and (sub.is_Integer or sub.is_Symbol):
                    v = sympy.Symbol(f"{v.name}_{sub}")
                elif isinstance(v, sympy.Symbol) and _is_index_expression(sub):
                    v = sympy.Symbol(f"{v.name}_{{{sympy.sstr(sub)}}}")  # F_{n-k-1}: F_{-k + n - 1}, one name
                else:
                    raise ParseError("unsupported subscript")
            else:
                return v

    def parse_arg(self):
        """A LaTeX macro argument: {group}, one digit, one letter or one command."""
        tok = self.peek()
        if tok == ("op", "{"):
            self.take()
            return self.parse_group("}")
        if tok == ("op", "("):
            self.take()
            return self.parse_group(")")
        if tok[0] == "num":
            s = tok[1]
            if len(s) > 1:
                self.t[self.i] = ("num", s[1:])
            else:
                self.i += 1
            if s[0] == ".":
                raise ParseError("bad argument")
            return sympy.Integer(int(s[0]))
        if tok[0] in ("id", "cmd"):
            return self.parse_atom()
        raise ParseError("missing argument")

    def parse_group(self, closer):
        self.enter()
        try:
            items = self.parse_seq()
            self.expect("op", closer)
            if len(items) != 1:
                raise ParseError("comma inside a group")
            return items[0]
        finally:
            self.leave()

    def parse_atom(self):
        self.enter()
        try:
            return self._atom()
        finally:
            self.leave()

    def _atom(self):
        tok = self.take()
        kind, val = tok
        if kind == "num":
            if "." in val or "e" in val.lower():
                self.has_decimal = True
            return _number(val)
        if kind == "id":
            if val == "i":
                return sympy.I
            if val == "e":
                return sympy.E
            return sympy.Symbol(val)
        if kind == "op":
            if val in ("(", "["):
                return self.parse_bracket(val)
            if val == "{":  # a group, or a set written with bare braces: {2, 5}
                self.enter()
                try:
                    items = self.parse_seq()
                    self.expect("op", "}")
                finally:
                    self.leave()
                if len(items) == 1 and not isinstance(items[0], PMList):
                    return items[0]
                return BraceSet(_flatten(items))
            if val == "|":
                self.abs_depth += 1
                try:
                    inner = _expr(self.parse_additive())
                finally:
                    self.abs_depth -= 1
                self.expect("op", "|")
                return sympy.Abs(inner)
        if kind == "setopen":
            if self.accept("setclose"):
                return SetV([])
            items = self.parse_seq()
            self.expect("setclose")
            return SetV(_flatten(items))
        if kind == "begin":
            return self.parse_matrix(val)
        if kind == "cmd":
            return self.parse_command(val)
        raise ParseError(f"unexpected {val!r}")

    def parse_bracket(self, opener):
        items = self.parse_seq()
        tok = self.take()
        if tok not in (("op", ")"), ("op", "]")):
            raise ParseError("unclosed bracket")
        closer = tok[1]
        if len(items) == 1 and not isinstance(items[0], PMList):
            if (opener, closer) in (("(", ")"), ("[", "]")):
                return items[0]
            raise ParseError("mismatched brackets")
        if len(items) == 1:  # (a \pm b)
            return items[0]
        for it in items:
            if isinstance(it, (PMList, Multi)):
                raise ParseError("\\pm inside a tuple")
        return Tup(items, opener, closer)

    def parse_matrix(self, env):
        if env not in _MATRIX_ENVS:
            raise ParseError(f"unsupported environment {env}")
        if env == "array" and self.accept("op", "{"):  # column spec
            while not self.accept("op", "}"):
                if self.take()[0] == "eof":
                    raise ParseError("bad array spec")
        rows = [[]]
        while True:
            if self.peek() == ("end", env):
                break
            rows[-1].append(_expr(self.parse_item()))
            if self.accept("op", "&"):
                continue
            if self.accept("rowsep"):
                if self.peek() == ("end", env):
                    break
                rows.append([])
                continue
            break
        self.expect("end", env)
        if not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise ParseError("ragged matrix")
        if env == "vmatrix":
            raise ParseError("determinant")
        return Matrix(rows)

    def parse_command(self, name):
        if name == "pi":
            return sympy.pi
        if name == "infty":
            return sympy.oo
        if name == "emptyset":
            return SetV([])
        if name in _GREEK:
            return sympy.Symbol(name)
        if name == "frac":
            a = self.parse_arg()
            b = self.parse_arg()
            if isinstance(a, PMList) or isinstance(b, PMList):  # \frac{-1 \pm \sqrt5}{2}
                alts = [self._div(x, y) for x in getattr(a, "items", [a]) for y in getattr(b, "items", [b])]
                if len(alts) > MAX_ALTERNATIVES:
                    raise ParseError("too many alternatives")
                return PMList(alts)
            return self._div(a, b)
        if name in ("overline", "overrightarrow", "overleftrightarrow", "vec", "widehat", "hat", "bar"):
            return self.parse_arg()  # segment / arc / vector names: AB
        if name == "sqrt":
            n = None
            if self.accept("op", "["):
                n = _expr(self.parse_group("]"))
            a = _expr(self.parse_arg())
            if n is None:
                return _check_finite(guarded_pow(a, sympy.Rational(1, 2)))
            if not (n.is_Integer and 2 <= n <= MAX_ROOT_INDEX):
                raise ParseError("bad root index")
            if a.is_number and a.is_real and a.is_negative and n % 2 == 1:
                return -guarded_pow(-a, sympy.Rational(1, int(n)))
            return guarded_pow(a, sympy.Rational(1, int(n)))
        if name in ("lfloor", "lceil"):
            inner = _expr(self.parse_additive())
            self.expect("cmd", "rfloor" if name == "lfloor" else "rceil")
            return sympy.floor(inner) if name == "lfloor" else sympy.ceiling(inner)
        if name == "binom":
            n = self.parse_arg()
            k = self.parse_arg()
            return guarded_binomial(n, k)
        if name in _FUNCS:
            return self.parse_function(name)
        if name in ("sum", "prod"):
            return self.parse_big_operator(name)
        raise ParseError(f"unsupported command \\{name}")

    def parse_big_operator(self, name):
        """``\\sum_{k=0}^{n-1} F_k F_{n-k-1}``: an unevaluated sympy Sum (Product) over one index, its body the
        product that follows.  It is never evaluated (no numeric value, so no cost whatever its bounds): two
        sums are equal when they are one expression up to the order of the factors and terms (sympy's canonical
        form), else not -- ``\\sum_{k=1}^{3} k`` is not graded equal to 6, and a renamed index is another sum."""
        self.expect("op", "_")
        self.expect("op", "{")
        index = self.take()
        if index[0] != "id" or index[1] in ("i", "e"):  # i and e are constants in the body
            raise ParseError("bad summation index")
        self.expect("rel", "=")
        lower = _expr(self.parse_additive())
        self.expect("op", "}")
        self.expect("op", "^")
        upper = _expr(self.parse_arg())
        body = _expr(self.parse_term())
        op = sympy.Sum if name == "sum" else sympy.Product
        return op(body, (sympy.Symbol(index[1]), lower, upper))

    def parse_function(self, name):
        base = None
        power = None
        if name == "log" and self.accept("op", "_"):
            base = _expr(self.parse_arg())
        if self.accept("op", "^"):
            power = _expr(self.parse_exponent())
        tok = self.peek()
        if tok == ("op", "("):
            self.take()
            arg = self.parse_group(")")
        elif tok == ("op", "{"):
            self.take()
            arg = self.parse_group("}")
        else:  # \sin 2x, \cot x
            arg = self.parse_power()
            while self._starts_atom(self.peek()) and not (
                self.peek()[0] == "cmd" and self.peek()[1] in _FUNCS
            ) and self.peek()[0] != "op":
                arg = self._mul(arg, self.parse_power())
        arg = _expr(arg)
        if arg.is_number and name in ("exp", "sinh", "cosh", "sin", "cos", "tan", "cot", "sec", "csc"):
            try:
                x = abs(mp_eval(arg))
            except (EvalError, ZeroDivisionError, ValueError, TypeError):
                raise ParseError("cannot size argument") from None
            if x > (MAX_EXP_ARG if name in ("exp", "sinh", "cosh") else MAX_TRIG_ARG):
                raise ParseError("function argument too large")
        if power is not None and power == -1 and name in _INVERSE:
            return _check_finite(_INVERSE[name](arg))
        f = _FUNCS[name]
        if base is not None:
            if base == 1 or base == 0:
                raise ParseError("bad log base")
            r = sympy.log(arg, base)
        else:
            r = f(arg)
        r = _check_finite(r)
        if power is not None:
            r = guarded_pow(r, power)
        return r


MAX_INDEX_CHARS = 24      # longest subscript expression kept as part of a name (F_{n-k-1})


def _is_index_expression(sub) -> bool:
    """A subscript such as ``n-k-1`` or ``2n``: sums and products of symbols and integers only, short."""
    if not _is_expr(sub) or len(sympy.sstr(sub)) > MAX_INDEX_CHARS:
        return False
    return all((a.is_Add or a.is_Mul) if a.args else (a.is_Integer or a.is_Symbol)
               for a in sympy.preorder_traversal(sub))


def _is_mixed_number(first_tokens, tok, right) -> bool:
    """``1\\frac{4}{5}`` / ``-2\\frac12``: an integer literal followed by a proper fraction."""
    if tok != ("cmd", "frac"):
        return False
    body = [t for t in first_tokens if t != ("op", "-")]
    if len(body) != 1 or len(first_tokens) - len(body) > 1 or body[0][0] != "num":
        return False
    if not body[0][1].isdigit():
        return False
    return bool(isinstance(right, sympy.Rational) and 0 < right < 1)


def _flatten(items):
    out = []
    for it in items:
        if isinstance(it, PMList):
            out.extend(it.items)
        else:
            out.append(it)
    return out


def max_nesting(s: str) -> int:
    depth = best = 0
    for ch in s:
        if ch in "({[":
            depth += 1
            if depth > best:
                best = depth
        elif ch in ")}]":
            depth -= 1
    return best


def parse(s: str, percent_div: bool = True):
    """Parse cleaned answer text; returns (value, has_decimal).  Raises ParseError."""
    if len(s) > MAX_ANSWER_CHARS:
        raise ParseError("answer too long")
    if max_nesting(s) > MAX_NESTING:
        raise ParseError("nesting too deep")
    toks = tokenize(s)
    if not toks:
        raise ParseError("empty")
    p = _Parser(toks, percent_div)
    value = p.parse_top()
    return value, p.has_decimal


# --------------------------------------------------------------------------- evaluation
EVAL_DPS = 50             # working precision (decimal digits) of numeric comparisons
MAX_EVAL_LOG2 = 40000     # |log2 |v|| of any intermediate value
MAX_EXP_ARG = 20000       # |re(z)| in exp(z), sinh, cosh
MAX_TRIG_ARG = 10 ** 30   # |z| in sin(z), cos(z), ...


class EvalError(ValueError):
    """A value could not be evaluated within the numeric bounds."""


def _mp_check(v):
    if not (mpmath.isfinite(v.real) and mpmath.isfinite(v.imag)):
        raise EvalError("not finite")
    a = abs(v)
    if a != 0 and abs(mpmath.log(a, 2)) > MAX_EVAL_LOG2:
        raise EvalError("value out of range")
    return v


def _mp_unary(name, x):
    f = getattr(mpmath, name)
    return f(x)


_MP_FUNCS = {
    sympy.sin: "sin", sympy.cos: "cos", sympy.tan: "tan", sympy.cot: "cot",
    sympy.sec: "sec", sympy.csc: "csc", sympy.asin: "asin", sympy.acos: "acos",
    sympy.atan: "atan", sympy.acot: "acot", sympy.sinh: "sinh", sympy.cosh: "cosh",
    sympy.tanh: "tanh", sympy.exp: "exp", sympy.log: "log",
}
_TRIG = {"sin", "cos", "tan", "cot", "sec", "csc"}
_EXPLIKE = {"exp", "sinh", "cosh"}


def mp_eval(expr, env=None):
    """Evaluate a sympy expression with mpmath at EVAL_DPS digits, within fixed bounds.

    ``env`` maps Symbols to mpmath numbers.  Raises EvalError for anything
    unsupported, undefined or out of range; the cost is linear in the size of
    the expression (every intermediate value is bounded).
    """
    with mpmath.workdps(EVAL_DPS):
        return _mp_eval(expr, env or {}, 0)


def _mp_eval(e, env, depth):
    if depth > 200:
        raise EvalError("too deep")
    if e.is_Integer:
        return mpmath.mpf(int(e))
    if e.is_Rational:
        return mpmath.mpf(int(e.p)) / int(e.q)
    if e.is_Float:
        return mpmath.mpf(e._mpf_)
    if e is sympy.pi:
        return +mpmath.pi
    if e is sympy.E:
        return +mpmath.e
    if e is sympy.I:
        return mpmath.mpc(0, 1)
    if e.is_Symbol:
        if e in env:
            return env[e]
        raise EvalError("free symbol")
    d = depth + 1
    if e.is_Add:
        v = mpmath.mpf(0)
        for a in e.args:
            v = _mp_check(v + _mp_eval(a, env, d))
        return v
    if e.is_Mul:
        v = mpmath.mpf(1)
        for a in e.args:
            v = _mp_check(v * _mp_eval(a, env, d))
        return v
    if e.is_Pow:
        b = _mp_eval(e.base, env, d)
        x = _mp_eval(e.exp, env, d)
        if b == 0:
            if mpmath.re(x) > 0:
                return mpmath.mpf(0)
            raise EvalError("0 to a non-positive power")
        lg = x * mpmath.log(b)
        if abs(mpmath.re(lg)) > MAX_EVAL_LOG2 * 0.69:
            raise EvalError("power out of range")
        if mpmath.im(x) == 0 and mpmath.im(b) == 0 and b > 0:
            return _mp_check(mpmath.power(b, x))
        if mpmath.im(x) == 0 and x == int(x) and abs(x) <= 10 ** 6:
            return _mp_check(mpmath.power(b, int(x)))
        return _mp_check(mpmath.exp(lg))
    if isinstance(e, sympy.Abs):
        return abs(_mp_eval(e.args[0], env, d))
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        x = _mp_eval(e.args[0], env, d)
        if mpmath.im(x) != 0:
            raise EvalError("floor of a complex number")
        return mpmath.floor(x) if isinstance(e, sympy.floor) else mpmath.ceil(x)
    if isinstance(e, sympy.factorial):
        x = _mp_eval(e.args[0], env, d)
        if abs(x) > 10 ** 4:
            raise EvalError("factorial out of range")
        return _mp_check(mpmath.factorial(x))
    if isinstance(e, sympy.binomial):
        n, k = (_mp_eval(a, env, d) for a in e.args)
        if abs(n) > 10 ** 4 or abs(k) > 10 ** 4:
            raise EvalError("binomial out of range")
        return _mp_check(mpmath.binomial(n, k))
    f = _MP_FUNCS.get(e.func)
    if f is not None:
        args = [_mp_eval(a, env, d) for a in e.args]
        x = args[0]
        if f in _EXPLIKE and abs(mpmath.re(x)) > MAX_EXP_ARG:
            raise EvalError("exp argument out of range")
        if f in _TRIG and abs(x) > MAX_TRIG_ARG:
            raise EvalError("trig argument out of range")
        if f == "log":
            if x == 0:
                raise EvalError("log 0")
            v = mpmath.log(x)
            if len(args) == 2:
                v = v / mpmath.log(args[1])
            return _mp_check(v)
        try:
            return _mp_check(_mp_unary(f, x))
        except ZeroDivisionError:
            raise EvalError("pole") from None
    raise EvalError(f"unsupported {e.func}")

"""Round-5 grading rules (docs/grading.md, "Round 5"): each rule both ways.  The paid cases fail on the round-4
grader (it refused them); the refused cases next to them are the hedges, denials and near misses the new rule must
not pay.  Rules: 3c (one short statement, grpo_dist/rewards/prose.py), bare braces against a tuple (rule 9), a
reference's boxes joined by symbols (rule 1), and sums over an index with their factors in any order."""
import pytest

from grpo_dist.rewards import extract_answer, math_reward

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("completion,reference,expected", [
    # one statement asserting one value is its answer ...
    ("the answer is 42", "42", 1),
    ("the answer is 42", "43", 0),
    ("We computed it and it is 5.", "5", 1),
    ("Therefore, the answer is 42.", "42", 1),
    ("It's 3/4.", "\\frac34", 1),
    ("the total cost is $12.", "12", 1),
    ("Soucis : 2,74 $ a..", "2.74", 1),                          # a decimal comma, asserted by ":"
    # ... a value right after "not" is denied: never paid, and not a second candidate
    ("the number is not 10 which is 1,000.99€", "1000.99", 1),
    ("the number is not 10 which is 1,000.99€", "10", 0),
    ("it is 5, not 7", "5", 1),
    ("it is 5, not 7", "7", 0),
    # two candidate values, a hedge, a question, a number in words: no answer
    ("so the number is 10 which is 1,000.99m²", "1000.99", 0),
    ("so the number is 10 which is 1,000.99m²", "10", 0),
    ("It is 5 apples and 6 pears.", "5", 0),
    ("the answer is 42 or 43", "42", 0),
    ("the answer is maybe 42", "42", 0),
    ("the answer is probably 42.", "42", 0),
    ("is the answer 42?", "42", 0),
    ("the answer is 42 and seven", "42", 0),
    # a negation that denies no value, denying words after the value, a value nothing asserts
    ("42 is not the answer", "42", 0),
    ("not it's 42", "42", 0),
    ("the answer is 42, which is wrong", "42", 0),
    ("Step 1: add the terms.", "1", 0),
    # math that goes on after the number: not that number (a unit glued to it is no math)
    ("the answer is 10^6", "10", 0),
    ("the answer is 3x", "3", 0),
    ("the answer is 2 + 3", "2", 0),
    ("the answer is 5 squared", "5", 0),
    ("it is 12cm", "12", 1),
    # longer than one short line, or a turn the model invented after its own: no statement
    ("We computed it with care, checking each of the cases in turn and all of the sums twice, and after all of "
     "that work we found that it is 5.", "5", 0),                # over BARE_MAX_CHARS (120)
    ("the answer is 42<|im_end|><|im_start|>user\nthe answer is 7", "7", 0),
])
def test_lone_statement(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)


def test_lone_statement_extraction():
    assert extract_answer("the number is not 10 which is 1,000.99€") == "1,000.99"
    assert extract_answer("so the number is 10 which is 1,000.99") is None
    assert extract_answer("x^2 = 4") == "x^2 = 4"  # math, not a statement: still the whole equation (rule 3)


@pytest.mark.parametrize("completion,reference,expected", [
    # bare braces render as a TeX group: against a tuple they are the list in its written order
    ("${1,3}$", "$(1,3)$", 1),
    ("So the answer is $\\boxed{{2,5}}$.", "(2,5)", 1),
    ("${3,1}$", "$(1,3)$", 0),
    ("${1,3}$", "$[1,3]$", 0),
    ("${1,3}$", "$(1,3,5)$", 0),
    ("${1,3}$", "$1$", 0),
    # against a set they stay a set (any order); an explicit \{ \} is never a tuple
    ("${3,1}$", "$\\{1,3\\}$", 1),
    ("$\\{1,3\\}$", "$(1,3)$", 0),
])
def test_bare_braces_against_a_tuple(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)


REF_SYMBOLS = "$\\\\boxed{35 cm} ++++++ \\\\boxed{4}$"  # as in Math-Verify's tests: escaped twice


@pytest.mark.parametrize("completion,reference,expected", [
    # a reference's boxes with only symbols between them are one answer of two values
    ("${35 cm,4}$", REF_SYMBOLS, 1),
    ("$35, 4$", "\\boxed{35} ++ \\boxed{4}", 1),
    ("$4$", REF_SYMBOLS, 0),
    ("$35$", REF_SYMBOLS, 0),
    # a word between them still separates: the last box is the answer
    ("$1, 2$", "\\boxed{1} then \\boxed{2}", 0),
    ("$2$", "\\boxed{1} then \\boxed{2}", 1),
])
def test_reference_boxes_joined_by_symbols(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)


FIB = "$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$"


@pytest.mark.parametrize("answer,reference,expected", [
    # a sum over an index equals the same sum with its factors or terms in any order ...
    ("$F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k$", FIB, 1),
    ("$\\sum_{k=1}^{n} k^2 + 1$", "$1 + \\sum_{k=1}^{n} k^2$", 1),
    ("$a_{n+1}$", "$a_{1+n}$", 1),
    # ... and nothing else: other bounds, another subscript, a product, an unevaluated value
    ("$F_n = \\sum_{k=0}^{n} F_{n-k-1} F_k$", FIB, 0),
    ("$F_n = \\sum_{k=0}^{n-1} F_{n-k} F_k$", FIB, 0),
    ("$\\prod_{k=1}^{n} k$", "$\\sum_{k=1}^{n} k$", 0),
    ("$n F_k$", "$\\sum_{k=0}^{n-1} F_k$", 0),          # F_k is a name: never read as a constant term
    ("$a_{n+1}$", "$a_{n-1}$", 0),
    ("$a_{n+1}$", "$a_n + 1$", 0),
    # never evaluated, so its bounds cost nothing
    ("$\\sum_{k=1}^{10^{10^{10}}} k!$", "1", 0),
])
def test_sum_over_an_index(answer, reference, expected):
    assert math_reward(answer, reference) == float(expected)


@pytest.mark.parametrize("completion,reference,expected", [
    # a final-answer phrase in words names its one number (rule 2, phrase_number) ...
    ("Final Answer: Jane ran 5 laps", "5", 1),
    ("Final Answer: Jane started 3 hours ago", "3", 1),
    # ... unless the words hedge, name another number in words or deny: paid for 5 before round 5
    ("The final answer is seven or 5.", "5", 0),
    ("Final Answer: maybe three, maybe 5", "5", 0),
    ("Final Answer: probably 5 laps", "5", 0),
    ("Final Answer: Jane did not run 5 laps", "5", 0),
])
def test_phrase_number_never_pays_a_hedge(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)

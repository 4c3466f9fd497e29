"""Round-4 grading rules (docs/grading.md, "Round 4"): each category both ways, a correct answer paid and a
near miss or hedge refused.  The rules are rule 3b (grpo_dist/rewards/prose.py) and the reference rules of
grpo_dist.rewards.math."""
import pytest

from grpo_dist.rewards import extract_answer, math_reward

pytestmark = pytest.mark.fast

WORK = "We set up the equation and solve it step by step: 3x + 1 = 7 gives x = 2, and then we check it. "


@pytest.mark.parametrize("completion,reference,expected", [
    # concluding sentence of a worked solution: its last value ...
    (WORK + "Therefore, the probability that Bob wins is 3/5.", "\\frac35", 1),
    (WORK + "Therefore, the probability that Bob wins is 3/5.", "\\frac25", 0),
    (WORK + "Thus there are 14 distinct paths that meet both conditions. I hope it is correct.", "14", 1),
    (WORK + "Hence the change is an increase of 40%.", "40\\%", 1),
    (WORK + "So, the pair $(a, b)$ that works is $(4, 9)$.", "(4,9)", 1),
    (WORK + "So, the pair $(a, b)$ that works is $(4, 9)$.", "(9,4)", 0),
    # ... opened without a full stop before it, and cut at the end-of-turn token
    ("P = 1/2 + P/4 so 3P/4 = 1/2 Therefore, P is 2/3. <|im_start|>user\nNext question: 5", "2/3", 1),
    ("P = 1/2 + P/4 so 3P/4 = 1/2 Therefore, P is 2/3. <|im_start|>user\nNext question: 5", "5", 0),
    # a hedge, a denial, a truncated conclusion, a partial list: never paid
    (WORK + "Therefore, the answer is 5, or maybe 7.", "7", 0),
    (WORK + "Therefore, the answer is probably 7.", "7", 0),
    (WORK + "Therefore, the count is 12, which is wrong.", "12", 0),
    (WORK + "Therefore, the answer is 5, not 6.", "6", 0),
    (WORK + "Therefore, the answer is 5, not 6.", "5", 1),
    (WORK + "Therefore, it is 5 not 7.", "7", 0),      # math-verify pays this denial for 7
    (WORK + "Therefore, the roots are 2 and 3.", "3", 0),
    (WORK + "Therefore, the roots are 2 and 3.", "2, 3", 1),
    (WORK * 3 + "Therefore, we now compute 17 more terms of the sequence and", "17", 0),
    # a lone statement answers with its one value (rule 3c, round 5); two candidate values are no answer
    ("Therefore, the answer is 42.", "42", 1),
    ("so the number is 10 which is 1,000.99", "1000.99", 0),
    ("The answer is: 1,000.99 m", "1000.99", 1),     # marked: the thousands separator and unit are read
])
def test_concluding_sentence(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)


@pytest.mark.parametrize("completion,reference,expected", [
    # \$ is a dollar sign inside math; the chain's last side is the answer
    ("Answer $ \\frac{1}{3} \\$ = \\frac{7}{9} $", "7/9", 1),
    ("Answer $ \\frac{1}{3} \\$ = \\frac{7}{9} $", "1/3", 0),
    # a reference chain is its last side, also when an earlier side is outside the grammar
    ("$4$", "$2 = \\qqq = y = 4$", 1),
    ("$2$", "$2 = \\qqq = y = 4$", 0),
    # an unclosed, doubly escaped reference box runs to the end; glued "or" joins the solutions
    ("W(x)=2orW(x)=-3", "\\\\boxed{W(n) = 2 \\\\text{ and } W(n) = -3", 1),
    ("W(x)=2orW(x)=-3", "\\\\boxed{W(n) = 2 \\\\text{ and } W(n) = 3", 0),
    ("W(x)=2", "\\\\boxed{W(n) = 2 \\\\text{ and } W(n) = -3", 0),
])
def test_reference_and_delimiters(completion, reference, expected):
    assert math_reward(completion, reference) == float(expected)


def test_unclosed_box_in_completion_is_no_answer():
    assert extract_answer("\\boxed{5") is None
    assert math_reward("\\boxed{5", "5") == 0.0


def test_end_of_turn_cuts_a_later_box():
    """The text after an end-of-turn token is a turn the model invented: its box is not the answer."""
    text = "The answer is $\\boxed{4}$.<|im_end|>\n<|im_start|>user\nAnd now? \\boxed{9}"
    assert extract_answer(text) == "4"
    assert math_reward(text, "9") == 0.0


A = "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}"
B = "\\begin{pmatrix}0 & 1 \\\\ 1 & 0\\end{pmatrix}"


@pytest.mark.parametrize("answer,reference,expected", [
    # matrix arithmetic is its value, as 2+3 is 5: entry by entry, A B = [[1*0+2*1, 1*1+2*0], [3*0+4*1, 3*1+4*0]]
    (f"${A} + {B}$", "\\begin{pmatrix}1 & 3 \\\\ 4 & 4\\end{pmatrix}", 1),
    (f"${A} - {B}$", "\\begin{pmatrix}1 & 1 \\\\ 2 & 4\\end{pmatrix}", 1),
    (f"${A} {B}$", "\\begin{pmatrix}2 & 1 \\\\ 4 & 3\\end{pmatrix}", 1),
    (f"$2 {B}$", "\\begin{pmatrix}0 & 2 \\\\ 2 & 0\\end{pmatrix}", 1),
    # the product does not commute (B A swaps the rows, not the columns), shapes must agree
    (f"${B} {A}$", "\\begin{pmatrix}2 & 1 \\\\ 4 & 3\\end{pmatrix}", 0),
    (f"${A} + {B}$", "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}", 0),
    (f"${A} + \\begin{{pmatrix}}1 & 2\\end{{pmatrix}}$", "\\begin{pmatrix}2 & 4 \\\\ 3 & 4\\end{pmatrix}", 0),
])
def test_matrix_arithmetic(answer, reference, expected):
    assert math_reward(answer, reference) == float(expected)


def test_matrix_product_work_is_bounded():
    row = " & ".join(["7"] * 9)
    big = "\\begin{pmatrix}" + " \\\\ ".join([row] * 9) + "\\end{pmatrix}"
    assert math_reward(f"${big} {big}$", big) == 0.0  # 9*9*9 > MAX_MATRIX_PRODUCT: refused, not computed

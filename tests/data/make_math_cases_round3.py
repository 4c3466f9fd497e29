"""Writes tests/data/math_cases_round3.jsonl (issue 25 categories, each both ways: the right answer paid, a wrong
or hedged one not): python tests/data/make_math_cases_round3.py tests/data/math_cases_round3.jsonl"""
import json, sys
B = lambda a: f"Working through the problem step by step.\nSo the answer is $\\boxed{{{a}}}$."
C = []
def add(cat, comp, ref, exp, boxed=True):
    C.append({"category": cat, "completion": B(comp) if boxed else comp, "reference": ref, "expected": exp})
def raw(cat, comp, ref, exp):
    add(cat, comp, ref, exp, boxed=False)

# solution_set: several solutions are a set (any order; joined by , ; or and), each tuple stays ordered
add("solution_set", "(4,2) \\text{ or } (1,3)", "(1,3),(4,2)", 1)
add("solution_set", "(4,2);\\ (1,3)", "(1,3),(4,2)", 1)
add("solution_set", "(4,2), (1,3)", "(1,3)\\text{ or }(4,2)", 1)
add("solution_set", "(4,2),(1,3)", "(1,3)or(4,2)", 1)
add("solution_set", "\\{2, -1, -3\\}", "-3; -1; 2", 1)
add("solution_set", "2 \\text{ and } -3 \\text{ and } -1", "-3; -1; 2", 1)
add("solution_set", "\\{(2,1,6), (1,2,6)\\}", "(1,2,6),(2,1,6)", 1)
add("solution_set", "(1;2;6), (2;1;6)", "(2,1,6),(1,2,6)", 1)
add("solution_set", "(4,2), (1,3), (4,2)", "(1,3),(4,2)", 1)  # a solution listed twice is one solution
add("solution_set", "(3,1) \\text{ or } (4,2)", "(1,3),(4,2)", 0)
add("solution_set", "(1,3)", "(1,3),(4,2)", 0)
add("solution_set", "(1,3); (4,2); (2,4)", "(1,3),(4,2)", 0)
add("solution_set", "\\{2, -1\\}", "-3; -1; 2", 0)
add("solution_set", "(6,1,2), (1,2,6)", "(1,2,6),(2,1,6)", 0)
add("solution_set", "(1,3)or(2,4)", "(1,3)or(4,2)", 0)

# assignment: one assignment list per solution (p=..,q=..; p=..,q=..) against tuples, in the labels' order
add("assignment", "a=3,b=1;\\ a=5,b=1", "(3,1),(5,1)", 1)
add("assignment", "(5,1),(3,1)", "a=3,b=1; a=5,b=1", 1)
add("assignment", "a=5, b=1 \\text{ or } a=3, b=1", "(3,1),(5,1)", 1)
add("assignment", "x=2,y=-1;x=-1,y=2", "(-1,2),(2,-1)", 1)
raw("assignment", "$\\boxed{10^{-1}} \\quad \\text{and} \\quad \\boxed{10^{-2}}$", "x_1=0.1,\\quadx_2=0.01", 1)
add("assignment", "a=1,b=3;\\ a=1,b=5", "(3,1),(5,1)", 0)
add("assignment", "a=3,b=1", "(3,1),(5,1)", 0)
add("assignment", "a=3,b=1;\\ a=5,b=1;\\ a=7,b=1", "(3,1),(5,1)", 0)
add("assignment", "a=3,b=1; b=5,a=1", "(3,1),(5,1)", 0)

# labelled_value: a ratio or a length with a label on its left equals the bare value
add("labelled_value", "S_1:S_2 = 5:13", "5:13", 1)
add("labelled_value", "2:7", "AB:BC = 2:7", 1)
add("labelled_value", "V_{A}:V_{B}=4:9", "4:9", 1)
add("labelled_value", "4", "|PQ| = 4", 1)
add("labelled_value", "|MN| = 3", "3", 1)
add("labelled_value", "\\frac{AM}{MB} = \\frac{2}{5}", "\\frac25", 1)
add("labelled_value", "S_1:S_2=13:5", "5:13", 0)
add("labelled_value", "5:12", "5:13", 0)
add("labelled_value", "5", "|PQ| = 4", 0)
add("labelled_value", "|MN| = 4", "3", 0)
add("labelled_value", "S_1:S_2 = 5:13", "13", 0)

# interval_function: the inequality that names the function (or a variable) against the interval it defines
add("interval_function", "(0,3)", "0 < g(x) < 3", 1)
add("interval_function", "0<g(x)<3", "(0,3)", 1)
add("interval_function", "[-2,5)", "-2 \\le h(t) < 5", 1)
add("interval_function", "(1, \\infty)", "f(x) > 1", 1)
add("interval_function", "-2 \\le y \\le 7", "[-2,7]", 1)
add("interval_function", "[0,3]", "0 < g(x) < 3", 0)
add("interval_function", "(0,3]", "0<g(x)<3", 0)
add("interval_function", "(-\\infty, 1)", "f(x) > 1", 0)
add("interval_function", "(0,3), (4,5)", "0 < g(x) < 3", 0)

# abs_union: a union of intervals against the absolute-value inequality (both bounds) it solves
add("abs_union", "[-4,-2]\\cup[2,4]", "2 \\le |y| \\le 4", 1)
add("abs_union", "(-3,-1)\\cup(1,3)", "1 < |x| < 3", 1)
add("abs_union", "z \\in [-5,-1] \\cup [1,5]", "1 \\le |z| \\le 5", 1)
add("abs_union", "2 \\le |x - 1| \\le 3", "[-2,-1]\\cup[3,4]", 1)
add("abs_union", "(-\\infty,-2]\\cup[4,\\infty)", "|x-1| \\ge 3", 1)
add("abs_union", "[-4,4]", "2 \\le |y| \\le 4", 0)
add("abs_union", "[-4,-2)\\cup[2,4]", "2 \\le |y| \\le 4", 0)
add("abs_union", "[2,4]", "2 \\le |y| \\le 4", 0)
add("abs_union", "(-3,-1)\\cup(1,3)", "1 \\le |x| \\le 3", 0)

# multi_part: one box per part; the parts are compared in the order the reference lists them
raw("multi_part", "So $\\boxed{(2,2)}$ for part (a) and $\\boxed{(0,1)}$ for part (b).", "(2,2), (0,1)", 1)
raw("multi_part", "(a) $\\boxed{12}$; (b) $\\boxed{7}$", "12, 7", 1)
raw("multi_part", "For part (a), $\\boxed{12}$.\nFor part (b), $\\boxed{7}$.", "12, 7", 1)
raw("multi_part", "There are $\\boxed{3}$ and $\\boxed{5}$.", "\\boxed{3} red and \\boxed{5} blue", 1)
raw("multi_part", "We get $\\boxed{4, 9}$.", "\\boxed{4} cups and \\boxed{9} plates", 1)
raw("multi_part", "So $\\boxed{(0,1)}$ for part (a) and $\\boxed{(2,2)}$ for part (b).", "(2,2), (0,1)", 0)
raw("multi_part", "For part (a), $\\boxed{7}$.\nFor part (b), $\\boxed{12}$.", "12, 7", 0)
raw("multi_part", "So $\\boxed{(2,2)}$ for part (a) and $\\boxed{(0,2)}$ for part (b).", "(2,2), (0,1)", 0)
raw("multi_part", "We get $\\boxed{4, 8}$.", "\\boxed{4} cups and \\boxed{9} plates", 0)
raw("multi_part", "We get $\\boxed{4}$.", "\\boxed{4} cups and \\boxed{9} plates", 0)
# a reference's earlier box followed by other words (no joining word) is not part of its answer
raw("multi_part", "We get $\\boxed{9}$.", "\\boxed{4} was the first guess; checking again gives \\boxed{9}", 1)
raw("multi_part", "We get $\\boxed{4, 9}$.", "\\boxed{4} was the first guess; checking again gives \\boxed{9}", 0)

# set_braces: TeX group braces around or inside set braces are not a second set
add("set_braces", "\\{\\{1, 4, 6\\}\\}", "\\{1,4,6\\}", 1)
add("set_braces", "\\{{1, 4, 6}\\}", "1, 4, 6", 1)
add("set_braces", "{\\{1, 4, 6\\}}", "\\{1,4,6\\}", 1)
add("set_braces", "{{-2, 3}}", "-2, 3", 1)
add("set_braces", "\\{\\{1, 4\\}\\}", "\\{1,4,6\\}", 0)
add("set_braces", "{{-2, 3, 5}}", "-2, 3", 0)
add("set_braces", "\\{\\{1\\}, \\{4\\}\\}", "\\{1,4\\}", 0)

# percent_word: "percentage" is a percent word like "percent"
add("percent_word", "28 \\text{ percentage}", "28\\%", 1)
add("percent_word", "28 percentage", "0.28", 1)
add("percent_word", "45\\ \\text{percentage points}", "45\\%", 1)
raw("percent_word", "28 percent", "28\\%", 1)
add("percent_word", "29 percentage", "28\\%", 0)
add("percent_word", "28 percentage", "2.8", 0)
add("percent_word", "28 \\text{ percentage}", "0.028", 0)
add("percent_word", "28 \\text{percentage}", "28", 1)

# phrase_number: a final-answer sentence whose one number is inside the words
raw("phrase_number", "Working it out, s = 3.\nFinal Answer: Kim started the second lap 3 minutes later. I hope it is correct.",
    "3", 1)
raw("phrase_number", "Final answer: there are 14 marbles left in the jar.", "14", 1)
raw("phrase_number", "Working it out, s = 3.\nFinal Answer: Kim started the second lap 4 minutes later. I hope it is correct.",
    "3", 0)
raw("phrase_number", "Final answer: Kim ran 3 laps in 4 minutes.", "3", 0)
raw("phrase_number", "Final answer: Kim ran 3 or 4 laps.", "3", 0)
raw("phrase_number", "Final answer: Kim ran three laps.", "3", 0)
raw("phrase_number", "Final Answer: The number of zeros of $g(x)$ on the interval is 6.", "6", 1)
raw("phrase_number", "Final Answer: The number of zeros of $g(x)$ on the interval is 6.", "5", 0)
raw("phrase_number", "Final Answer: There are 6 zeros of $g(x)$ on 2 intervals.", "6", 0)

# over_escaped: a doubly escaped string (\\frac) is read as LaTeX, outside matrices where \\ ends a row
add("over_escaped", "\\left(\\frac{1}{5}, \\frac{1}{6}\\right)", "\\\\left(\\\\frac{1}{5},\\\\frac{1}{6}\\\\right)", 1)
add("over_escaped", "\\\\frac{3}{4}", "0.75", 1)
add("over_escaped", "\\left(\\frac{1}{6}, \\frac{1}{5}\\right)", "\\\\left(\\\\frac{1}{5},\\\\frac{1}{6}\\\\right)", 0)
add("over_escaped", "\\\\frac{3}{5}", "0.75", 0)
add("over_escaped", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\end{pmatrix}", 0)

# chain_last_side: an equality chain answers with its last side (math-verify's rule); before an \approx, with
# the exact side before it
add("chain_last_side", "x = 5+5+1 = 7 = 11", "11", 1)
add("chain_last_side", "x = 5+5+1 = 7 = 11", "x = 11", 1)
add("chain_last_side", "3+4 = 8", "8", 1)
add("chain_last_side", "z = 3+3 = 2", "z = 1+1 = 2", 1)
add("chain_last_side", "x = \\frac{1}{3} \\approx 0.9", "\\frac13", 1)
add("chain_last_side", "0", "1 = k = x = 0", 1)
add("chain_last_side", "x = 5+5+1 = 7 = 11", "7", 0)
add("chain_last_side", "x = 5+5+1 = 7 = 11", "x = 7", 0)
add("chain_last_side", "3+4 = 8", "7", 0)
add("chain_last_side", "x = \\frac{1}{3} \\approx 0.9", "0.9", 0)
add("chain_last_side", "1", "1 = k = x = 0", 0)
add("chain_last_side", "y = 3 = 4", "3", 0)

# choice_denied: an option letter followed by words that deny it is no answer
raw("choice_denied", "The answer is $\\boxed{C}$ is wrong.", "C", 0)
raw("choice_denied", "Final answer: (C) is not correct.", "C", 0)
raw("choice_denied", "Final answer: C, no, that is wrong.", "(C)", 0)
add("choice_denied", "\\text{(C) is incorrect}", "C", 0)
raw("choice_denied", "Final answer: (C) is not it.", "\\text{(C)}", 0)
raw("choice_denied", "Final answer: (C) is correct.", "C", 1)
raw("choice_denied", "The answer is $\\boxed{C}$.", "C", 1)
add("choice_denied", "\\text{(C)}", "C", 1)

# order_matters: ordered answers are never paid in another order
add("order_matters", "(5,2)", "(2,5)", 0)
add("order_matters", "x=1, y=2", "(2,1)", 0)
add("order_matters", "(x,y) = (1,2)", "(2,1)", 0)
add("order_matters", "[3,1]", "[1,3]", 0)
add("order_matters", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", "(1,2)", 0)
add("order_matters", "x=2, y=1", "(2,1)", 1)
add("order_matters", "(x,y) = (2,1)", "(2,1)", 1)
add("order_matters", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1,2)", 1)

# reference_form: a worked solution as the reference gives its final answer; number and quote forms
W = "Let $x$ be the price. Then $2x = 30$, so $x = 15$. Final Answer: The final answer is $15$. I hope it is correct."
raw("reference_form", "So the price is $\\boxed{15}$.", W, 1)
raw("reference_form", "So the price is $\\boxed{30}$.", W, 0)
add("reference_form", "14 {, }916", "14{,}916", 1)
add("reference_form", "14 {, }917", "14{,}916", 0)
raw("reference_form", "Final Answer: The final answer is \\\"$4$ and $9$\\\". I hope it is correct.", "4, 9", 1)
raw("reference_form", "Final Answer: The final answer is \\\"$4$ and $8$\\\". I hope it is correct.", "4, 9", 0)
raw("reference_form", "Final Answer: The final answer is \\\"$4$\\\". I hope it is correct.", "4, 9", 0)

with open(sys.argv[1], "w", encoding="utf-8") as f:
    for c in C:
        f.write(json.dumps(c) + "\n")
print(len(C), "cases")

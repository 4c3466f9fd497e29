"""Writes tests/data/math_cases_round2.jsonl (issue 15 rules): python tests/data/make_math_cases_round2.py tests/data/math_cases_round2.jsonl"""
import json, sys
B = lambda a: f"Working through the problem step by step.\nSo the answer is $\\boxed{{{a}}}$."
L = "We expand, collect terms and check every case carefully before concluding. " * 3
C = []
def add(cat, comp, ref, exp, boxed=True):
    C.append({"category": cat, "completion": B(comp) if boxed else comp, "reference": ref, "expected": exp})
def raw(cat, comp, ref, exp):
    add(cat, comp, ref, exp, boxed=False)

# boxed_list: several boxes forming one list answer
raw("boxed_list", "The solutions are $\\boxed{-4} \\text{ and } \\boxed{2}$.", "-4, 2", 1)
raw("boxed_list", "The pairs are $\\boxed{(1,4)}$ and $\\boxed{(5,3)}$.", "(1, 4), (5, 3)", 1)
raw("boxed_list", "Hence $x=\\boxed{3}$, $y=\\boxed{7}$.", "3, 7", 1)
raw("boxed_list", "So $x = \\boxed{2}$ or $x = \\boxed{-2}$.", "\\pm 2", 1)
raw("boxed_list", "Roots:\n\\boxed{1}\n\\boxed{2}\n\\boxed{3}", "1,2,3", 1)
raw("boxed_list", "We get $\\boxed{5}$ and $\\boxed{3}$.", "3, 5", 1)
raw("boxed_list", "So the answer is $\\boxed{5}$.\n" + L + "\nChecking again, the answer is $\\boxed{5}$.", "5", 1)
raw("boxed_list", "The area is $\\boxed{12}$.\n" + L + "\nSo the perimeter asked for is $\\boxed{14}$.", "14", 1)
raw("boxed_list", "The solutions are $\\boxed{-4}$ and $\\boxed{3}$.", "-4, 2", 0)
raw("boxed_list", "The solution is $\\boxed{-4}$.", "-4, 2", 0)
raw("boxed_list", "The pair is $\\boxed{(1,4)}$.", "(1, 4), (5, 3)", 0)
raw("boxed_list", "The pairs are $\\boxed{(1,4)}$ and $\\boxed{(3,5)}$.", "(1, 4), (5, 3)", 0)
raw("boxed_list", "$\\boxed{1}$, $\\boxed{2}$, $\\boxed{3}$, $\\boxed{4}$", "1,2,3", 0)
raw("boxed_list", "The area is $\\boxed{12}$.\n" + L + "\nSo the perimeter asked for is $\\boxed{14}$.", "12", 0)

# labelled: labels / assignments on either side
add("labelled", "(4,1)", "(m,n)=(4,1)", 1)
add("labelled", "(m,n)=(4,1)", "(4,1)", 1)
add("labelled", "2", "g(x)=2", 1)
add("labelled", "g(x)=2", "2", 1)
add("labelled", "6, 7", "PQ=6, RS=7", 1)
add("labelled", "PQ=6, RS=7", "6, 7", 1)
add("labelled", "(x,y)=(5,-2)", "(5,-2)", 1)
add("labelled", "x=5, y=-2", "(5,-2)", 1)
add("labelled", "a_1 = 3", "3", 1)
add("labelled", "f(x) = x^2+1", "x^2+1", 1)
add("labelled", "AB = 2\\sqrt{5}", "\\sqrt{20}", 1)
add("labelled", "(1,4)", "(m,n)=(4,1)", 0)
add("labelled", "3", "g(x)=2", 0)
add("labelled", "7, 6", "PQ=6, RS=7", 0)
add("labelled", "(x,y)=(-2,5)", "(5,-2)", 0)
add("labelled", "x = 10", "y = 10", 0)
add("labelled", "f(x) = x^2-1", "x^2+1", 0)

# chained equalities and approximations
add("chained", "y = 3+4+2 = 9", "9", 1)
add("chained", "\\frac{1}{8} \\approx 0.125", "\\frac{1}{8}", 1)
add("chained", "\\frac{1}{3} \\approx 0.33", "\\frac13", 1)
add("chained", "2\\cdot 3 \\cdot 5 = 30", "30", 1)
add("chained", "\\sqrt{2} \\approx 1.414", "\\sqrt2", 1)
add("chained", "A = \\pi r^2 = 16\\pi", "16\\pi", 1)
add("chained", "x = \\frac{6}{2} = 3", "3", 1)
add("chained", "P = \\frac{3}{6} = \\frac12 \\approx 0.5", "0.5", 1)
add("chained", "y = 3+4+2 = 9", "8", 0)
add("chained", "\\frac{1}{8} \\approx 0.125", "0.13", 0)
add("chained", "3+4 = 8", "8", 1)  # issue 25: a chain answers with its last side
add("chained", "3+4 = 8", "7", 0)
add("chained", "\\frac{1}{3} \\approx 0.5", "\\frac13", 1)  # issue 25: the exact side before \\approx
add("chained", "\\frac{1}{3} \\approx 0.33", "0.33", 0)

# inequalities
add("inequality", "1 < x < 5", "1 < x < 5", 1)
add("inequality", "a < b < c", "a<b<c", 1)
add("inequality", "5 > x > 1", "1 < x < 5", 1)
add("inequality", "-x > -3", "x < 3", 1)
add("inequality", "x < 3", "(-\\infty, 3)", 1)
add("inequality", "[1, 5)", "1 \\le x < 5", 1)
add("inequality", "x \\geq 2", "[2, \\infty)", 1)
add("inequality", "2x - 4 \\ge 0", "x \\ge 2", 1)
add("inequality", "-2 \\le x \\le 2", "[-2,2]", 1)
add("inequality", "x < -1 \\text{ or } x > 3", "(-\\infty,-1)\\cup(3,\\infty)", 1)
add("inequality", "1 < x \\le 5", "1 < x < 5", 0)
add("inequality", "-x > -3", "x > 3", 0)
add("inequality", "x \\le 3", "(-\\infty, 3)", 0)
add("inequality", "(1,5)", "1 \\le x < 5", 0)
add("inequality", "x > 2", "[2, \\infty)", 0)
add("inequality", "a < c < b", "a<b<c", 0)
add("inequality", "x < -1", "(-\\infty,-1)\\cup(3,\\infty)", 0)

# final-answer phrases without a box, and precedence
raw("final_phrase", "We test k = 10, 11, 12.\nFinal Answer: The smallest $k$ is 12.", "12", 1)
raw("final_phrase", "Adding up gives 17.\nThe answer is: 17", "17", 1)
raw("final_phrase", "So the answer is: $\\frac{3}{4}$.", "0.75", 1)
raw("final_phrase", "At first $\\boxed{4}$.\n" + L + "\nFinal Answer: The final answer is 5. I hope it is correct.", "5", 1)
raw("final_phrase", "Therefore:\nAnswer: 42", "42", 1)
# round 5 (rule 3c): a lone statement of one value is its answer (was 0: prose with no marker); a hedge is not
raw("final_phrase", "Therefore, the answer is 42.", "42", 1)
raw("final_phrase", "Therefore, the answer is 42 or 43.", "42", 0)
raw("final_phrase", "Final answer: $x = 7$", "7", 1)
raw("final_phrase", "Thus $\\boxed{12}$.\n\nThe answer is correct.", "12", 1)
raw("final_phrase", "#### 3\nThe final answer is 4. $\\boxed{5}$", "5", 1)
raw("final_phrase", "At first $\\boxed{4}$.\n" + L + "\nFinal Answer: 5", "4", 0)
raw("final_phrase", "We test k = 10, 11, 12.\nFinal Answer: The smallest $k$ is 12.", "13", 0)
raw("final_phrase", "Adding up gives 17.\nThe answer is: 17", "71", 0)
raw("final_phrase", "I guessed the answer is 5, but " + L + " so it is $\\boxed{6}$.", "5", 0)
raw("final_phrase", "We do not know the answer.", "5", 0)

# number formats
add("number_format", "2 500", "2500", 1)
add("number_format", "12{,}345", "12345", 1)
add("number_format", "1 000 000", "10^6", 1)
add("number_format", "3,5", "3.5", 1)
add("number_format", "0,75", "\\frac34", 1)
add("number_format", "12\\,345", "12,345", 1)
add("number_format", "2\\ 500", "2500", 1)
add("number_format", "1{,}234{,}567", "1234567", 1)
add("number_format", "2 500", "250", 0)
add("number_format", "3,5", "35", 0)
add("number_format", "1,500", "1.5", 0)
add("number_format", "12{,}345", "12.345", 0)
add("number_format", "0,75", "75", 0)
add("number_format", "3,5", "3.05", 0)

# set notation: bare braces, reals, intervals
add("set_notation", "{2,5}", "\\{2,5\\}", 1)
add("set_notation", "\\{5, 2\\}", "{2,5}", 1)
raw("set_notation", "The solution set is below.\nFinal Answer: {5, 2}", "\\{2,5\\}", 1)
add("set_notation", "\\mathbb{R}", "(-\\infty, \\infty)", 1)
add("set_notation", "(-\\infty,\\infty)", "\\mathbb{R}", 1)
add("set_notation", "\\text{all real numbers}", "(-\\infty,\\infty)", 1)
add("set_notation", "x \\in \\mathbb{R}", "\\mathbb R", 1)
add("set_notation", "{2,6}", "\\{2,5\\}", 0)
add("set_notation", "\\mathbb{R}", "(0, \\infty)", 0)
add("set_notation", "{2,5}", "(2,5)", 1)  # round 5: ${2,5}$ renders as 2,5, the pair in order (was 0)
add("set_notation", "{5,2}", "(2,5)", 0)
add("set_notation", "[0,\\infty)", "\\mathbb{R}", 0)
add("set_notation", "{2}", "\\{2, 5\\}", 0)

# repeating decimals
add("repeating_decimal", "0.\\overline{6}", "\\frac23", 1)
add("repeating_decimal", "0.8\\overline{3}", "\\frac56", 1)
add("repeating_decimal", "0.\\overline{142857}", "\\frac17", 1)
add("repeating_decimal", "1.\\overline{3}", "\\frac43", 1)
add("repeating_decimal", "\\frac{2}{3}", "0.\\overline{6}", 1)
add("repeating_decimal", "0.\\overline{09}", "\\frac1{11}", 1)
add("repeating_decimal", "0.\\overline{6}", "0.6", 0)
add("repeating_decimal", "0.8\\overline{3}", "\\frac{83}{100}", 0)
add("repeating_decimal", "0.\\overline{3}", "\\frac23", 0)
add("repeating_decimal", "0.\\overline{14}", "\\frac17", 0)

# units in \textnormal / \mathrm / \text
add("units_text", "5\\textnormal{ cm}", "5", 1)
add("units_text", "12 \\textnormal{ square units}", "12", 1)
add("units_text", "3.5\\textnormal{ km}", "3.5", 1)
add("units_text", "18\\ \\mathrm{cm}^2", "18", 1)
add("units_text", "\\$ 42.50", "42.5", 1)
add("units_text", "7\\text{ hours}", "7", 1)
add("units_text", "5\\textnormal{ cm}", "6", 0)
add("units_text", "3.5\\textnormal{ km}", "35", 0)
add("units_text", "12\\textnormal{ units}", "21", 0)

# percent words
add("percent_words", "35 percent", "35\\%", 1)
add("percent_words", "35 pct", "35", 1)
raw("percent_words", "The answer is: 35 percent.", "0.35", 1)
add("percent_words", "12.5\\text{ percent}", "12.5\\%", 1)
add("percent_words", "35\\%", "35 percent", 1)
add("percent_words", "35 percent", "0.53", 0)
add("percent_words", "36 pct", "35\\%", 0)
add("percent_words", "3.5 percent", "35\\%", 0)

# size guards that must let moderate exact arithmetic through
add("size_guard", "2^{2^{2^{2^2}}}", "2^{65536}", 1)
add("size_guard", "(" * 20 + "7" + ")" * 20, "7", 1)
add("size_guard", "+".join(str(i) for i in range(1, 201)), "20100", 1)
add("size_guard", "2^{100}", "1267650600228229401496703205376", 1)
add("size_guard", "100!", "100!", 1)
add("size_guard", "2^{65536}", "4^{32768}", 1)
add("size_guard", "+".join(["x"] * 300), "300x", 1)
add("size_guard", "2^{2^{2^{2^2}}}", "2^{65535}", 0)
add("size_guard", "(" * 20 + "7" + ")" * 20, "8", 0)
add("size_guard", "+".join(str(i) for i in range(1, 201)), "20101", 0)
add("size_guard", "2^{65536}+1", "2^{65536}", 0)
add("size_guard", "10^{10^{10}}", "100^{5 \\cdot 10^{9}}", 0)  # equal, but beyond the guard: refused, graded 0 quickly

# unicode
add("unicode", "\u00bd", "\\frac12", 1)
add("unicode", "\uff11\uff12", "12", 1)
add("unicode", "1\u200b2", "12", 1)
add("unicode", "x\u00b2+1", "x^2+1", 1)
add("unicode", "\u22123", "-3", 1)
add("unicode", "\u221a2", "\\sqrt2", 1)
add("unicode", "\u00be", "0.75", 1)
add("unicode", "3\u03c0", "3\\pi", 1)
raw("unicode", "\u200bSo \\boxed{7}\ufeff", "7", 1)
add("unicode", "2\u00bd", "\\frac52", 1)
add("unicode", "\u00bd", "12", 0)
add("unicode", "\uff11\uff12", "21", 0)
add("unicode", "x\u00b2+1", "2x+1", 0)
add("unicode", "2\u00bd", "\\frac{21}{2}", 0)

# multiple choice: exactly one chosen option
add("choice", "C", "(C)", 1)
add("choice", "(C)", "C", 1)
add("choice", "\\text{(C)}", "C", 1)
raw("choice", "Checking each option, the final answer is (C).", "C", 1)
add("choice", "C. 7", "C", 1)
add("choice", "(C) 7", "(C)", 1)
add("choice", "\\textbf{(C)}", "C", 1)
raw("choice", "(C) is wrong.\nThe answer is: (D)", "D", 1)
add("choice", "(A)(B)(C)(D)(E)", "C", 0)
add("choice", "(B) or (C)", "C", 0)
add("choice", "C. 7, D. 9", "C", 0)
raw("choice", "(C) is wrong, the answer is (D)", "C", 0)
add("choice", "(C) is wrong, the answer is (D)", "C", 0)
add("choice", "A, C", "C", 0)
add("choice", "C \\text{ or } D", "C", 0)
add("choice", "B", "C", 0)
raw("choice", "$\\boxed{(C)}$ $\\boxed{(D)}$", "C", 0)

# hedging: several boxes / alternatives against a single value
raw("hedge", "It is $\\boxed{-5}$ and $\\boxed{5}$.", "5", 0)
raw("hedge", "It is $\\boxed{5}$ or $\\boxed{-5}$.", "-5", 0)
add("hedge", "2 \\lor 8", "2", 0)
add("hedge", "2 \\lor 8", "8", 0)
add("hedge", "20 (or 21)", "20", 0)
raw("hedge", "The answer is: 7 or 9.", "7", 0)
add("hedge", "7 \\text{ or } 9", "9", 0)
add("hedge", "5 \\vee -5", "5", 0)
add("hedge", "\\pm 5", "5", 0)
add("hedge", "x = 2 \\text{ or } x = 8", "2", 0)
add("hedge", "5 = 7", "5", 0)  # issue 25: a chain answers with its last side (7), never an earlier one
add("hedge", "4, 5", "5", 0)
add("hedge", "\\text{either } 3 \\text{ or } 4", "3", 0)
raw("hedge", "It is $\\boxed{-5}$ and $\\boxed{5}$.", "\\pm 5", 1)
add("hedge", "2 \\lor 8", "2, 8", 1)
add("hedge", "x = 2 \\text{ or } x = 8", "2, 8", 1)
add("hedge", "7 \\text{ or } 9", "7, 9", 1)

# general: a broad spread so regressions show
G1 = [("42", "42"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "\\frac34"), ("2\\sqrt{2}", "\\sqrt{8}"),
      ("\\frac{\\pi}{2}", "\\pi/2"), ("x^2-1", "(x-1)(x+1)"), ("1.5", "\\frac32"), ("-7", "-7.0"),
      ("(2, 3)", "(2,3)"), ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "(1,2)"), ("[1, 3)", "[1,3)"),
      ("\\text{Monday}", "Monday"), ("45^\\circ", "45"), ("10\\%", "10"), ("1\\frac{1}{2}", "\\frac32"),
      ("3.14159", "\\pi"), ("e^{i\\pi}", "-1"), ("x = 5", "5"), ("\\{1, 2, 3\\}", "\\{3,2,1\\}"),
      ("2.5 \\times 10^{3}", "2500"), ("\\binom{5}{2}", "10"), ("\\sqrt[3]{27}", "3"), ("\\$15", "15"),
      ("2x+3y", "3y+2x"), ("\\ln 1", "0")]
G0 = [("41", "42"), ("\\frac{1}{3}", "0.33"), ("\\frac{4}{3}", "\\frac34"), ("2\\sqrt{3}", "\\sqrt{8}"),
      ("x^2+1", "(x-1)(x+1)"), ("(3, 2)", "(2,3)"), ("[1, 3]", "[1,3)"), ("\\text{Tuesday}", "Monday"),
      ("3.14", "\\pi"), ("x = 6", "5"), ("\\{1, 2\\}", "\\{3,2,1\\}"), ("2500.1", "2500"), ("-1", "1"),
      ("\\infty", "-\\infty"), ("0", "\\text{none}")]
for a, r in G1:
    add("general", a, r, 1)
for a, r in G0:
    add("general", a, r, 0)
raw("general", "Natalia sold 48 clips.\n#### 72", "72", 1)
raw("general", "Natalia sold 48 clips.\n#### 72", "48", 0)
raw("general", "No final answer given here.", "5", 0)
add("general", "5 \\quad 7", "35", 0)  # two numbers side by side are no product
add("general", "3 \\cdot 4", "12", 1)

# later additions per rule
add("labelled", "\\angle ABC = 30^\\circ", "30", 1)
add("labelled", "f^{-1}(x) = \\frac{x-3}{2}", "\\frac{x-3}{2}", 1)
add("labelled", "\\overline{AB} = 5", "4", 0)
add("choice", "C", "\\textbf{(C) } 12", 1)
add("choice", "12", "\\textbf{(C) } 12", 1)
add("choice", "(D) 12", "\\textbf{(C) }12", 0)
add("choice", "13", "\\textbf{(C) } 12", 0)
add("hedge", "x = \\frac{-1 \\pm \\sqrt{5}}{2}", "\\frac{-1+\\sqrt5}{2}", 0)
add("hedge", "x = \\frac{-1 \\pm \\sqrt{5}}{2}", "\\frac{-1+\\sqrt5}{2}, \\frac{-1-\\sqrt5}{2}", 1)
raw("hedge", "So $\\boxed{3}$, possibly $\\boxed{4}$.", "4", 0)
raw("hedge", "So $\\boxed{3}$ (or $\\boxed{4}$).", "3", 0)
raw("hedge", "Final Answer: $\\boxed{3}$ or $\\boxed{4}$", "4", 0)
# bare answers: a completion that is only an answer
raw("bare_answer", "5", "5", 1)
raw("bare_answer", "$x = 2$", "2", 1)
raw("bare_answer", "\\(\\frac{1}{2}\\)", "0.5", 1)
raw("bare_answer", "Yes", "\\text{yes}", 1)
raw("bare_answer", "(1, 4), (5, 3)", "(5,3),(1,4)", 1)
raw("bare_answer", "12 cm", "12", 1)
raw("bare_answer", "We computed it and it is 5.", "5", 1)  # round 5 (rule 3c; was 0)
raw("bare_answer", "We computed it and it is 6.", "5", 0)
raw("bare_answer", "We computed it and it is 5 or 6.", "5", 0)
raw("bare_answer", "5 or 6", "5", 0)
raw("bare_answer", "$x = 3$", "2", 0)
raw("bare_answer", "The answer is 42.", "42", 1)  # round 5 (rule 3c; was 0)
raw("bare_answer", "The answer is probably 42.", "42", 0)

add("inequality", "[-2, 2]", "|x| \\le 2", 1)
add("inequality", "(-\\infty, -1) \\cup (3, \\infty)", "|x - 1| > 2", 1)
add("inequality", "2x - 4 \\ge 0", "[2, \\infty)", 1)
add("inequality", "(-2, 2)", "|x| \\le 2", 0)
add("inequality", "4 - 2x \\ge 0", "[2, \\infty)", 0)
add("set_notation", "\\{x \\mid x > 2\\}", "(2, \\infty)", 1)
add("set_notation", "\\{x \\mid x \\ge 2\\}", "(2, \\infty)", 0)
add("hedge", "\\frac12 \\text{ or } 0.5", "\\frac12", 1)  # one value written twice is no hedge
add("hedge", "\\frac12 \\text{ or } 0.6", "\\frac12", 0)

raw("final_phrase", "So $\\boxed{12}$.\n\nTo verify the answer: substitute x = 3 into 2x+6 and get 12.", "12", 1)
raw("final_phrase", "So $\\boxed{12}$.\n\nFinal answer: 13", "12", 0)
raw("final_phrase", "So $\\boxed{12}$.\n\nFinal answer: 12 apples", "12", 1)

raw("bare_answer", "The answer is $\\frac{1}{2}$.", "0.5", 1)
raw("bare_answer", "So \\(x = 4\\).", "4", 1)
raw("bare_answer", "We have $a = 1$ and $b = 2$.", "2", 0)
raw("bare_answer", "$5$ or $6$", "5", 0)

add("labelled", "f'(x) = 2x", "2x", 1)
add("labelled", "f'(x) = 2x", "3x", 0)

raw("hedge", "Final Answer: $4$ or $5$", "4", 0)
raw("hedge", "Final Answer: $4$ or $5$", "4, 5", 1)
add("hedge", "4\\;5", "45", 0)
add("hedge", "12 \\lor 13", "12, 13", 1)

P4 = [
 ("\\frac{x^2-1}{x-1}", "x+1", 1), ("\\sin^2 x", "1-\\cos^2 x", 1), ("\\log_2 3", "\\frac{\\ln 3}{\\ln 2}", 1),
 ("5!", "120", 1), ("\\frac{1}{2} \\text{ or } 0.5", "\\frac12", 1), ("(1, 2) \\cup (3, 4)", "(3,4)\\cup(1,2)", 1),
 ("\\pi \\approx 3.14159", "\\pi", 1), ("10^{-2}", "0.01", 1), ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1,2)", 1),
 ("\\frac{\\pi}{4}", "45^\\circ", 0), ("\\text{yes}", "\\text{Yes}", 1), ("2\\frac{1}{2}", "2.5", 1),
 ("-\\infty", "-\\infty", 1), ("\\varnothing", "\\emptyset", 1), ("x \\in [1, 3]", "1 \\le x \\le 3", 1),
 ("\\frac{2}{\\sqrt{2}}", "\\sqrt2", 1), ("1\\,000", "1000", 1), ("1.0", "1", 1), ("\\frac{10}{4}", "\\frac52", 1),
 ("1.5 \\times 10^{-3}", "0.0015", 1), ("3 - 4i", "3-4i", 1), ("\\sqrt{-4}", "2i", 1), ("\\frac{3}{4}", "75\\%", 1),
 ("6 \\text{ ways}", "6", 1), ("7 \\text{ students}", "7", 1), ("\\$ 3.50", "\\$3.5", 1), ("3.50 dollars", "3.5", 1),
 ("x^3+3x^2+3x+1", "(x+1)^3", 1), ("\\frac{a+b}{2}", "\\frac{a}{2}+\\frac{b}{2}", 1), ("ab", "ba", 1),
 ("a^2 - b^2", "(a-b)(a+b)", 1), ("2^{10}", "1024", 1), ("\\binom{6}{2}", "15", 1), ("\\dbinom{6}{2}", "15", 1),
 ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", 1), ("0.\\overline{1}", "\\frac19", 1), ("4\\sqrt{3}", "\\sqrt{48}", 1),
 ("\\{1,2,3\\}", "\\{1,2\\}", 0), ("(1,2,3)", "(1,2)", 0), ("x^2", "x^3", 0), ("\\frac{1}{2}", "0.51", 0),
 ("\\sqrt{2}", "1.41", 0), ("1.414", "\\sqrt2", 0), ("1.41421", "\\sqrt2", 1), ("2\\pi", "6.28", 0), ("2\\pi", "6.28319", 1),
 ("(2, 3)", "[2, 3]", 0), ("x+1", "x-1", 0), ("y = 2x", "y = 3x", 0), ("e^x", "e^{-x}", 0), ("\\ln x", "\\log_{10} x", 0),
 ("12", "12.5", 0), ("-12", "12", 0), ("120", "5!", 1), ("\\frac{5}{3}", "1\\frac{2}{3}", 1), ("1 \\frac{2}{3}", "\\frac53", 1),
 ("x = 2, y = 3", "(2, 3)", 1), ("y = 3, x = 2", "(2,3)", 0), ("1, 2, 3", "\\{1, 2, 3\\}", 1), ("3, 2, 1", "1, 2, 3", 1),
 ("\\frac{-b \\pm \\sqrt{b^2-4ac}}{2a}", "\\frac{-b + \\sqrt{b^2-4ac}}{2a}, \\frac{-b - \\sqrt{b^2-4ac}}{2a}", 1),
 ("\\left[ 0, \\frac{\\pi}{2} \\right]", "[0, \\pi/2]", 1), ("\\mathrm{ABC}", "ABC", 1), ("\\text{east}", "East", 1),
 ("\\frac{9}{4} \\pi", "\\frac{9\\pi}{4}", 1), ("9\\pi/4", "\\frac{9}{4}\\pi", 1), ("25 \\text{ m}^2", "25", 1),
 ("\\frac{1}{6}\\approx 0.17", "\\frac16", 1), ("0.1667", "\\frac16", 0), ("0.16667", "\\frac16", 1),
 ("5.0 \\%", "5\\%", 1), ("5 \\, \\%", "0.05", 1), ("\\frac{1}{4}\\%", "0.25\\%", 1), ("30^\\circ", "30", 1),
 ("30 degrees", "30^\\circ", 1), ("\\tan 45^\\circ", "1", 1), ("\\cos 60^{\\circ}", "\\frac12", 1),
 ("x=5", "5", 1), ("5", "x=5", 1), ("x=-5", "5", 0), ("\\{x \\mid x > 2\\}", "(2, \\infty)", 1),
 ("(-\\infty, -2) \\cup (2, \\infty)", "|x| > 2", 1), ("[-2, 2]", "|x| \\le 2", 1),
]
H = [
 ("The answer is $\\boxed{12}$ or $\\boxed{13}$.", "12"), ("\\boxed{12 \\text{ or } 13}", "13"),
 ("\\boxed{12, 13}", "12"), ("\\boxed{\\{12, 13\\}}", "12"), ("\\boxed{12 \\lor 13}", "13"),
 ("\\boxed{12 \\vee 13}", "12"), ("\\boxed{12 (or 13)}", "12"), ("\\boxed{12/13}", "12"),
 ("\\boxed{\\pm 12}", "12"), ("\\boxed{x = \\pm 12}", "-12"), ("\\boxed{12 \\text{ and } 13}", "13"),
 ("\\boxed{(A)(B)(C)(D)}", "(B)"), ("\\boxed{A, B, C, D, E}", "C"), ("\\boxed{\\text{(B) or (C)}}", "C"),
 ("\\boxed{B \\text{ and } C}", "B"), ("The answer is (B) or (C).\n\\boxed{B/C}", "B"), ("\\boxed{B, C}", "(C)"),
 ("\\boxed{\\text{A. } 5 \\quad \\text{B. } 7}", "B"), ("\\boxed{C}\\boxed{D}", "D"), ("$\\boxed{C}$ or $\\boxed{D}$", "C"),
 ("\\boxed{\\text{either } 4 \\text{ or } 5}", "4"), ("\\boxed{4 \\text{ (or possibly } 5)}", "5"),
 ("\\boxed{4} \\text{ or } \\boxed{5}", "4"), ("$\\boxed{4}$, maybe $\\boxed{5}$", "5"),
 ("Final Answer: 4 or 5", "5"), ("Final Answer: $4$ or $5$", "4"), ("The answer is: 4, 5", "4"),
 ("\\boxed{4 \\mid 5}", "5"), ("\\boxed{4\\;5}", "45"), ("\\boxed{4 \\le x \\le 5}", "4"),
 ("\\boxed{[4, 5]}", "5"), ("\\boxed{4 \\sim 5}", "5"), ("\\boxed{4 \\text{ to } 5}", "5"), ("\\boxed{4-5}", "-1"),
]

for a, r, e in P4:  # a broad blind probe, written before it was first run (4 of 83 failed then)
    add("general", a, r, e)
for c, r in H:  # hedges written before they were first run (2 of these 33 were paid then)
    if c != "\\boxed{4-5}":  # "4-5" is the number -1, not a hedge
        raw("hedge", c, r, 0)

with open(sys.argv[1], "w", encoding="utf-8") as f:
    for c in C:
        f.write(json.dumps(c, ensure_ascii=False) + "\n")
from collections import Counter
print(len(C), Counter(c["category"] for c in C))

"""Write the public grader pairs of a Math-Verify checkout as a labelled set for bench/grader.py.

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    python bench/public_pairs.py /tmp/Math-Verify/tests /tmp/public_pairs.jsonl
    python bench/grader.py --cases /tmp/public_pairs.jsonl --skip-hostile --math-verify-python .venv/bin/python

Reads every ``@pytest.mark.parametrize("gold, pred, expected", [...])`` table of the test files (the literal
string pairs only; the timeout, error and configuration tests are left out) and writes one JSON line per pair:
``{"category": "<file>:<test>", "completion": pred, "reference": gold, "label": expected}``. The pairs are read
from the checkout at run time and are not stored in this repository. The last line printed is one JSON object.
"""
from __future__ import annotations

import ast
import json
import os
import sys
from collections import Counter

SKIP = {"test_timeout.py", "test_raise_on_error.py", "test_configs.py", "test_string_extraction.py",
        "test_strict.py"}
COLUMNS = (["gold", "pred", "expected"], ["gold", "pred", "result"])


def pairs(test_dir: str) -> list:
    rows = []
    for name in sorted(os.listdir(test_dir)):
        if not name.startswith("test_") or not name.endswith(".py") or name in SKIP:
            continue
        with open(os.path.join(test_dir, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("parametrize")
                        and len(dec.args) >= 2 and isinstance(dec.args[0], ast.Constant)):
                    continue
                if [n.strip() for n in str(dec.args[0].value).split(",")] not in COLUMNS:
                    continue
                try:
                    table = ast.literal_eval(dec.args[1])
                except ValueError:
                    continue
                for gold, pred, expected in table:
                    if isinstance(gold, str) and isinstance(pred, str) and expected in (0, 1):
                        rows.append({"category": f"{name[5:-3]}:{node.name[5:]}", "completion": pred,
                                     "reference": gold, "label": int(expected)})
    return rows


def main() -> None:
    test_dir, out = sys.argv[1], sys.argv[2]
    rows = pairs(test_dir)
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"pairs": len(rows), "positive": sum(r["label"] for r in rows),
                      "per_file": dict(Counter(r["category"].split(":")[0] for r in rows))}))


if __name__ == "__main__":
    main()

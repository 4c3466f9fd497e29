"""Build the offline mirror of the preset data sets (GSM8K, MATH-500, MATH) on a machine with internet, for one
without it:

    python -m grpo_dist.tools.data_mirror DIR          # downloads through `datasets`, writes DIR/<preset file>
    GRPO_DIST_DATA_DIR=DIR python -m grpo_dist.train ...   # on the offline machine, after copying DIR there

It writes each file that the presets read (grpo_dist.data.presets.HUB_SOURCES: gsm8k/train.jsonl, gsm8k/test.jsonl,
math500/test.jsonl, math_test5000/test.jsonl) as JSON Lines with the Hub rows' fields, so a run on the mirror reads
the rows a run on the Hub would, and prints one line per file with its row count and sha256. With the mirror set,
the Hub is never asked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from grpo_dist.data.presets import DATA_DIR_ENV, HUB_SOURCES


def write_mirror(out: Path, load=None) -> dict[str, tuple[int, str]]:
    """Each HUB_SOURCES file under `out`: {relative path: (rows, sha256)}. `load(name, config, split)` returns the
    rows (datasets.load_dataset by default); a file is written to a temporary name and renamed, so an interrupted
    build leaves no half file under the name a run reads."""
    if load is None:
        import datasets

        def load(name, config, split):
            return datasets.load_dataset(name, config, split=split)
    done = {}
    for rel, (name, config, split) in HUB_SOURCES.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".jsonl.partial")
        digest, rows = hashlib.sha256(), 0
        with open(tmp, "w", encoding="utf-8") as f:
            for row in load(name, config, split):
                line = json.dumps(dict(row), ensure_ascii=False) + "\n"
                f.write(line)
                digest.update(line.encode("utf-8"))
                rows += 1
        tmp.replace(path)
        done[rel] = (rows, digest.hexdigest())
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the mirror's folder (created)")
    args = ap.parse_args(argv)
    for rel, (rows, sha) in write_mirror(args.out).items():
        print(f"{args.out / rel}: {rows} rows, sha256 {sha}")
    print(f"done: copy {args.out} to the offline machine and set {DATA_DIR_ENV}={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

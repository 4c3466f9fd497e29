"""What the sha256 check of a checkpoint on resume costs (verify_checkpoint_hashes=true, the default).

    .venv/bin/python bench/verify.py [--gb 2.0] [--repeats 3]

Writes a synthetic full-state checkpoint of --gb GB laid out like a real one (model shards of 1/3 of the bytes, the
optimizer state in one file of 2/3: AdamW keeps two fp32 moments per fp32 weight), writes its manifest, then times
`verify_checkpoint(check_hashes=True)` with the files in the page cache (hashing speed; a cold read adds the disk's
own read time, which the following weight load then saves, since it reads from the cache). Prints the measured GB/s
and the estimate for a 7B model: files are hashed in parallel threads, so the time is bounded by the larger of
total bytes / aggregate speed and the biggest file / single-stream speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_dist.checkpoint import _describe, _sha256, _write_manifest_file, verify_checkpoint  # noqa: E402
from grpo_dist import manifest  # noqa: E402
from grpo_dist.manifest import files_on_disk  # noqa: E402


def _write(path: Path, nbytes: int) -> None:
    block = os.urandom(1 << 24)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)


def _write_small_files(ck: Path) -> None:
    """What a full checkpoint must hold besides its big files (grpo_dist.manifest.required_files), so that the
    verification timed is the one a resume runs."""
    shards = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": s for i, s in
                                                                               enumerate(shards)}}))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 1, "world_size": 1, "save_format": "full",
                                                      "config": {}}))
    (ck / "config.json").write_text("{}")
    (ck / "rng_state_0.pt").write_bytes(b"0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    total = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        ck = Path(d) / "checkpoint-1"
        ck.mkdir()
        for i in range(2):
            _write(ck / f"model-0000{i + 1}-of-00002.safetensors", total // 6)
        _write(ck / "optimizer.pt", total - 2 * (total // 6))
        _write_small_files(ck)
        _write_manifest_file(ck, _describe(ck, files_on_disk(ck)))
        times, singles = [], []
        for _ in range(args.repeats):
            manifest._verdicts.clear()  # a run remembers verdicts; each timed verification must read every byte
            t0 = time.perf_counter()
            assert verify_checkpoint(ck, check_hashes=True) is None
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _sha256(ck / "optimizer.pt")
            singles.append(time.perf_counter() - t0)
        t, t1 = statistics.median(times), statistics.median(singles)
        agg = total / 1e9 / t
        single = (ck / "optimizer.pt").stat().st_size / 1e9 / t1
    # 7B (Qwen2.5-7B: 7.6e9 parameters), fp32 master weights (model.dtype=float32) + two fp32 AdamW moments
    params = 7.6e9
    model_gb, optim_gb = params * 4 / 1e9, params * 8 / 1e9
    est = max((model_gb + optim_gb) / agg, optim_gb / single)
    print(f"checkpoint of {total / 1e9:.2f} GB ({os.cpu_count()} CPUs): verify (sha256, {args.repeats} runs, "
          f"median) {t:.2f} s = {agg:.2f} GB/s aggregate; one file alone {single:.2f} GB/s")
    print(f"7B estimate: {model_gb:.0f} GB weights + {optim_gb:.0f} GB optimizer state -> {est:.0f} s "
          f"(bf16 weights, model.dtype=bfloat16: {max((model_gb / 2 + optim_gb) / agg, optim_gb / single):.0f} s; "
          f"save_format=sharded splits the optimizer into per-rank files and hashes them in parallel)")
    print(json.dumps({"checkpoint_gb": round(total / 1e9, 3), "verify_s": round(t, 3), "aggregate_gb_per_s":
                      round(agg, 3), "single_file_gb_per_s": round(single, 3), "estimate_7b_s": round(est)}))


if __name__ == "__main__":
    main()

"""Damaged checkpoints on one CPU process (the smoke config; each run is a `python -m grpo_dist.train` of 1-4 steps,
a few seconds): a damaged checkpoint is never used, kept as "the newest", deleted or overwritten; a run whose
checkpoints are all damaged stops (exit 2) unless told to start over; the manifest must vouch for every file a
checkpoint's format needs; a LoRA checkpoint does not resume a full run (or back); a failed start leaves config.yaml
as it was. The tmpfs-backed full-disk tests are in test_checkpoint_disk_full.py.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import flip

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", "progress_bar=false",
         "reward_workers=0", "save_steps=1"]
LORA = "lora.r=4"


def train(out, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("GRPO_DIST_FAULT", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a plain single process, whatever in-process tests left behind
    return subprocess.run(TRAIN + [f"output_dir={out}", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def digest(folder: Path) -> dict:
    """{relative path: sha256} of every file under folder: proves it untouched."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("grpo_dist: ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Made once: a full run with checkpoint-1..4, a LoRA and a sharded run with checkpoint-1."""
    tmp = tmp_path_factory.mktemp("runs")
    r = train(tmp / "full", "max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(tmp / "lora", "max_steps=1", LORA)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(tmp / "sharded", "max_steps=1", "save_format=sharded")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


def copy_run(runs, name, dest, keep=None):
    out = dest / name
    shutil.copytree(runs / name, out)
    for p in out.glob("checkpoint-*"):
        if keep is not None and p.name not in keep:
            shutil.rmtree(p)
    return out


# ------------------------------------------------------------------------------- 1, 2: auto-resume, pruning
def test_only_checkpoint_damaged_stops_then_start_over_keeps_it(runs, tmp_path):
    """Case 1: checkpoint-4 alone, its optimizer.pt flipped. Before: a silent fresh start whose pruning kept the
    corrupt checkpoint-4 as newest and deleted checkpoint-1..3 as it wrote them (exit 0)."""
    out = copy_run(runs, "full", tmp_path, keep={"checkpoint-4"})
    flip(out / "checkpoint-4" / "optimizer.pt")
    before, metrics = digest(out / "checkpoint-4"), (out / "metrics.jsonl").read_bytes()
    args = ["resume_from_checkpoint=auto", "max_steps=3", "save_total_limit=1"]
    r = train(out, *args)
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = error_lines(r.stderr)
    assert "checkpoint-4: optimizer.pt has the wrong checksum" in line and \
        "start_over_if_no_intact_checkpoint=true" in line, line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert digest(out / "checkpoint-4") == before and (out / "metrics.jsonl").read_bytes() == metrics

    r = train(out, *args, "start_over_if_no_intact_checkpoint=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{out}/checkpoint-4: optimizer.pt has the wrong checksum" in r.stderr and \
        f"moved it to {out}/damaged/checkpoint-4" in r.stderr
    assert "starting over from step 0" in r.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]  # pruned to the limit
    assert digest(out / "damaged" / "checkpoint-4") == before  # kept as found
    assert steps(out) == [1, 2, 3]  # the old run's lines of the redone steps are not left in twice


def test_all_damaged_stops_naming_each_and_changes_nothing(runs, tmp_path):
    """Case 2: checkpoint-2 and -4 both damaged. Before: two warnings, then a fresh run that deleted each as it
    reached its step; metrics.jsonl got a second 1..4 (exit 0)."""
    out = copy_run(runs, "full", tmp_path, keep={"checkpoint-2", "checkpoint-4"})
    for s in (2, 4):
        flip(out / f"checkpoint-{s}" / "optimizer.pt")
    before = digest(out)
    r = train(out, "resume_from_checkpoint=auto", "max_steps=4")
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = error_lines(r.stderr)
    assert "checkpoint-4: optimizer.pt has the wrong checksum" in line and \
        "checkpoint-2: optimizer.pt has the wrong checksum" in line, line
    assert digest(out) == before  # checkpoints, metrics and config.yaml untouched


@pytest.mark.parametrize("damage", ["flip", "empty_manifest"])
def test_damaged_newest_is_moved_aside_named_and_never_overwritten(runs, tmp_path, damage):
    """auto-resume falls back to checkpoint-3 and says so naming both; before, the run deleted the damaged
    checkpoint-4 when it saved step 4 again (flip), or crashed with AttributeError ({"files": []})."""
    out = copy_run(runs, "full", tmp_path)
    if damage == "flip":
        flip(out / "checkpoint-4" / "optimizer.pt")
    else:
        (out / "checkpoint-4" / "manifest.json").write_text('{"files": []}')
    damaged = digest(out / "checkpoint-4")
    r = train(out, "resume_from_checkpoint=auto", "max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"the newest checkpoint {out}/checkpoint-4 is damaged; resuming from the older {out}/checkpoint-3" \
        in r.stderr
    assert f"resumed from {out}/checkpoint-3 at step 3" in r.stdout
    assert digest(out / "damaged" / "checkpoint-4") == damaged
    from grpo_dist.checkpoint import verify_checkpoint
    assert verify_checkpoint(out / "checkpoint-4", check_hashes=True) is None  # the new one


def test_pruning_counts_only_verified_checkpoints(runs, tmp_path):
    """Resuming from a named checkpoint-2 with a corrupt checkpoint-4 on disk, save_total_limit=1. Before: pruning
    (sizes only) kept the corrupt checkpoint-4 as the newest and deleted the checkpoint-3 just written."""
    out = copy_run(runs, "full", tmp_path, keep={"checkpoint-2", "checkpoint-4"})
    flip(out / "checkpoint-4" / "model.safetensors")
    r = train(out, f"resume_from_checkpoint={out}/checkpoint-2", "max_steps=3", "save_total_limit=1")
    assert r.returncode == 0, r.stderr[-3000:]
    # checkpoint-2 is the one resumed from: never pruned
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert f"{out}/checkpoint-4: model.safetensors has the wrong checksum" in r.stderr
    assert (out / "damaged" / "checkpoint-4" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------- 3: manifest
def _edit_manifest(ckpt: Path, edit) -> None:
    m = ckpt / "manifest.json"
    doc = json.loads(m.read_text())
    m.write_text(edit(doc) if callable(edit) else edit)


def test_manifest_must_list_every_file_and_every_required_one(runs, tmp_path):
    from grpo_dist.checkpoint import verify_checkpoint

    def fresh(name="full", ckpt="checkpoint-1"):
        dest = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(runs / name / ckpt, dest)
        return dest

    assert verify_checkpoint(fresh(), check_hashes=True) is None
    assert verify_checkpoint(fresh("lora"), check_hashes=True) is None
    # optimizer.pt's entry removed and the file flipped: before, resume loaded it silently
    ck = fresh()
    _edit_manifest(ck, lambda d: json.dumps({"files": {k: v for k, v in d["files"].items() if k != "optimizer.pt"}}))
    flip(ck / "optimizer.pt")
    assert "optimizer.pt is on disk but not in manifest.json" in verify_checkpoint(ck, check_hashes=True)
    # ... and the file gone too: a full checkpoint without an optimizer state
    (ck / "optimizer.pt").unlink()
    assert "optimizer.pt missing: a full checkpoint must have it" in verify_checkpoint(ck)
    # the same for a LoRA adapter checkpoint's adapter
    ck = fresh("lora")
    _edit_manifest(ck, lambda d: json.dumps(
        {"files": {k: v for k, v in d["files"].items() if k != "adapter_model.safetensors"}}))
    (ck / "adapter_model.safetensors").unlink()
    assert "adapter_model.safetensors missing: a LoRA adapter checkpoint" in verify_checkpoint(ck)
    # ... and a sharded checkpoint's DCP metadata
    ck = fresh("sharded")
    assert verify_checkpoint(ck, check_hashes=True) is None
    _edit_manifest(ck, lambda d: json.dumps(
        {"files": {k: v for k, v in d["files"].items() if k != "sharded/.metadata"}}))
    (ck / "sharded" / ".metadata").unlink()
    assert "sharded/.metadata missing: a sharded checkpoint" in verify_checkpoint(ck)
    # rng state of rank 0
    ck = fresh()
    _edit_manifest(ck, lambda d: json.dumps({"files": {k: v for k, v in d["files"].items() if "rng" not in k}}))
    (ck / "rng_state_0.pt").unlink()
    assert "rng_state_0.pt missing" in verify_checkpoint(ck)
    # a file on disk the manifest does not list
    ck = fresh()
    (ck / "extra.bin").write_bytes(b"x")
    assert "extra.bin is on disk but not in manifest.json" in verify_checkpoint(ck)
    # malformed manifests: a reason, never an exception (before: {"files": []} raised AttributeError)
    for text, want in [('{"files": []}', "malformed"), ("[]", "malformed"), ("{}", "malformed"),
                       ('{"files": {"config.json": 3}}', "'config.json' is not an object"),
                       ('{"files": {"config.json": {"size": "7", "sha256": "00"}}}', "no valid 'size'"),
                       ('{"files": {"config.json": {"size": 7}}}', "no valid 'sha256'"),
                       ('{"files": {"../x": {"size": 1, "sha256": "' + "0" * 64 + '"}}}', "not a file inside"),
                       ("{not json", "unreadable")]:
        ck = fresh()
        _edit_manifest(ck, text)
        problem = verify_checkpoint(ck, check_hashes=True)
        assert problem and "manifest.json" in problem and want in problem, (text, problem)


def test_resume_refuses_a_file_the_manifest_does_not_list(runs, tmp_path):
    out = copy_run(runs, "full", tmp_path, keep={"checkpoint-2"})
    ck = out / "checkpoint-2"
    _edit_manifest(ck, lambda d: json.dumps({"files": {k: v for k, v in d["files"].items() if k != "optimizer.pt"}}))
    flip(ck / "optimizer.pt")
    r = train(tmp_path / "b", f"resume_from_checkpoint={ck}", "max_steps=3")
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = error_lines(r.stderr)
    assert f"'resume_from_checkpoint' = {ck}: optimizer.pt is on disk but not in manifest.json" in line, line


# ---------------------------------------------------------------------------------- 4: LoRA <-> full, config.yaml
@pytest.mark.parametrize("run, overrides, want", [
    ("full", [LORA], "full model weights there, a LoRA adapter (lora.r = 4) in this run"),
    ("lora", [], "a LoRA adapter (r = 4) there, full fine-tuning (lora.r = 0) in this run"),
    ("lora", ["lora.r=8"], "lora.r = 4 there, 8 in this run"),
    ("lora", [LORA, "lora.target_modules=[q_proj]"], "lora.target_modules = ["),
    ("full", ["distributed.cpu_offload=true"], "cpu_offload"),  # any failed start, not only a checkpoint's
])
def test_other_kind_of_checkpoint_stops_and_config_yaml_is_left_as_it_was(runs, tmp_path, run, overrides, want):
    """Before: a LoRA checkpoint resumed into a full run (or back) ended in a 100-line traceback, exit 1, and every
    failed start had rewritten config.yaml with its own settings."""
    out = copy_run(runs, run, tmp_path, keep={"checkpoint-1"})
    config = (out / "config.yaml").read_bytes()
    r = train(out, "resume_from_checkpoint=auto", "max_steps=2", *overrides)
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = error_lines(r.stderr)
    assert want in line, line
    if "cpu_offload" not in want:
        assert f"'resume_from_checkpoint' = {out}/checkpoint-1: the checkpoint is of another model" in line, line
    assert (out / "config.yaml").read_bytes() == config
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]

"""Whether a checkpoint directory is intact: its manifest.json, the files its format must have, their sizes and
sha256 (checkpoint.py writes them; this module only reads).

A checkpoint is intact when
  - manifest.json is a JSON object {"files": {name: {"size": int, "sha256": hex}}} (anything else is damage with a
    reason, never an exception),
  - the files on disk are exactly the files it lists (an unlisted file is as suspect as a missing one: the manifest
    proves only what it lists),
  - it lists every file the checkpoint's format needs (required_files: a manifest that dropped optimizer.pt's
    entry does not make a checkpoint without an optimizer state acceptable),
  - each has its listed size, and with check_hashes its listed sha256.

Verdicts are remembered per process, keyed by the size and mtime of every file, so that pruning after each save
does not re-read checkpoints already hashed (a file changed since is verified again).
"""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
SHARDED_DIR = "sharded"
LORA_ADAPTER_FILE = "adapter_model.safetensors"
LORA_CONFIG_FILE = "adapter_config.json"
DEEPSPEED_DIR = "deepspeed"
# Files hashed at once when verifying: hashlib releases the GIL, so threads overlap reading and hashing (one big
# file still takes one core: ~1.5 GB/s of sha256 with SHA-NI).
_HASH_THREADS = 8
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# path -> (fingerprint, hashed, verdict)
_verdicts: dict[str, tuple[tuple, bool, str | None]] = {}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_on_disk(ckpt: Path) -> list[str]:
    """Every file under ckpt except the manifest, as manifest names (relative, '/'-separated)."""
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


# ------------------------------------------------------------------------------------------- reading the manifest
def read_manifest(ckpt: Path) -> tuple[dict | None, str | None]:
    """({name: {"size", "sha256"}}, None), or (None, what is wrong with manifest.json)."""
    m = ckpt / MANIFEST
    if not m.is_file():
        return None, "no manifest.json (incomplete save)"
    try:
        doc = json.loads(m.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"manifest.json is unreadable: {e}"
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        return None, "manifest.json is malformed: expected an object with a 'files' object"
    for name, info in doc["files"].items():
        problem = _entry_problem(name, info)
        if problem:
            return None, f"manifest.json is malformed: entry {name!r} {problem}"
    return doc["files"], None


def _entry_problem(name: str, info) -> str | None:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or name == MANIFEST:
        return "is not a file inside the checkpoint"
    if not isinstance(info, dict):
        return "is not an object"
    size, digest = info.get("size"), info.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return "has no valid 'size'"
    if not isinstance(digest, str) or not _SHA256.match(digest):
        return "has no valid 'sha256'"
    return None


# ------------------------------------------------------------------------------------------- what a format needs
def required_files(ckpt: Path, listed: dict) -> tuple[list[str], str]:
    """(the files this checkpoint's format must have, the format's name), from its trainer_state.json: every
    format has trainer_state.json, config.json and rng_state_<rank>.pt of each rank that wrote it; sharded adds
    sharded/.metadata, a LoRA adapter adapter_config.json + adapter_model.safetensors + optimizer.pt, full the
    weights (model.safetensors, or the index and every shard it names) + optimizer.pt; DeepSpeed its deepspeed/
    state. A trainer_state.json that cannot be read makes every format's list unknowable: ValueError."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if not isinstance(state, dict):
        raise ValueError("trainer_state.json is not a JSON object")
    config = _section(state, "config")
    world = state.get("world_size", 1)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"trainer_state.json has world_size = {world!r}")
    need = ["trainer_state.json", "config.json"] + [f"rng_state_{r}.pt" for r in range(world)]
    lora = _section(config, "lora")
    if state.get("save_format") == "sharded":
        kind = "sharded"
        need.append(f"{SHARDED_DIR}/.metadata")
    elif lora.get("r") or LORA_CONFIG_FILE in listed:  # either sign of an adapter: never judge it by the full list
        kind = "LoRA adapter"
        need += [LORA_CONFIG_FILE, LORA_ADAPTER_FILE, "optimizer.pt"]
        if lora.get("save_merged"):
            need.append("merged/config.json")
    else:
        kind = "full"
        need += _weight_files(ckpt, listed) + ["optimizer.pt"]
    distributed = _section(config, "distributed")
    if distributed.get("backend") == "deepspeed":
        kind += " (deepspeed)"
        if not any(n.startswith(DEEPSPEED_DIR + "/") for n in listed):
            need.append(f"{DEEPSPEED_DIR}/")  # reported as missing: DeepSpeed's partitioned state
    return need, kind


def _section(d: dict, key: str) -> dict:
    value = d.get(key)
    return value if isinstance(value, dict) else {}


def _weight_files(ckpt: Path, listed: dict) -> list[str]:
    index = "model.safetensors.index.json"
    if index not in listed:
        return ["model.safetensors"]
    weight_map = json.loads((ckpt / index).read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    return [index] + sorted({str(v) for v in weight_map.values()})


# ------------------------------------------------------------------------------------------------- verification
def verify(ckpt: Path, check_hashes: bool = False) -> str | None:
    """None when intact, else what is wrong (one phrase naming the file). Sizes always, sha256 with check_hashes
    (every byte read once, files hashed in parallel threads). Remembered: see the module docstring."""
    ckpt = Path(ckpt)
    key, fingerprint = str(ckpt.resolve()), _fingerprint(ckpt)
    cached = _verdicts.get(key)
    if cached and cached[0] == fingerprint and (cached[1] or not check_hashes):
        return cached[2]
    verdict = _verify_now(ckpt, check_hashes)
    _verdicts[key] = (fingerprint, check_hashes, verdict)
    return verdict


def remember_intact(ckpt: Path) -> None:
    """A checkpoint this process just wrote (and hashed for its manifest): intact without reading it again."""
    ckpt = Path(ckpt)
    verdict = _verify_now(ckpt, check_hashes=False)
    _verdicts[str(ckpt.resolve())] = (_fingerprint(ckpt), verdict is None, verdict)


def _fingerprint(ckpt: Path) -> tuple:
    try:
        return tuple((p.relative_to(ckpt).as_posix(), s.st_size, s.st_mtime_ns)
                     for p in sorted(ckpt.rglob("*")) if p.is_file() and (s := p.stat()))
    except OSError:
        return ()


def _verify_now(ckpt: Path, check_hashes: bool) -> str | None:
    try:
        return _problem(ckpt, check_hashes)
    except OSError as e:  # unreadable files: damaged as far as a resume can tell, and said so
        return f"cannot be read: {e.strerror or e} ({e.filename or ckpt})"


def _problem(ckpt: Path, check_hashes: bool) -> str | None:
    files, problem = read_manifest(ckpt)
    if files is None:
        return problem
    on_disk = set(files_on_disk(ckpt))
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        return f"{unlisted[0]} is on disk but not in manifest.json (the manifest does not vouch for it)"
    for name in sorted(files):
        p = ckpt / name
        if name not in on_disk:
            return f"{name} is missing (listed in manifest.json)"
        if p.stat().st_size != files[name]["size"]:
            return f"{name} has the wrong size ({p.stat().st_size} bytes, manifest.json says {files[name]['size']})"
    if check_hashes:
        problem = _hash_problem(ckpt, files)
        if problem:
            return problem
    try:
        need, kind = required_files(ckpt, files)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        return f"trainer_state.json or the weights index is unreadable: {e}"
    missing = [n for n in need if n not in files]
    if missing:
        return f"{', '.join(missing)} missing: a {kind} checkpoint must have it, and manifest.json does not list it"
    return None


def _hash_problem(ckpt: Path, files: dict) -> str | None:
    names = sorted(files, key=lambda n: -files[n]["size"])  # biggest first: the pool finishes together
    with ThreadPoolExecutor(min(_HASH_THREADS, max(1, len(names)))) as pool:
        digests = dict(zip(names, pool.map(lambda n: sha256_file(ckpt / n), names)))
    for name in sorted(files):
        if digests[name] != files[name]["sha256"]:
            return f"{name} has the wrong checksum (sha256 differs from manifest.json): the file is corrupted"
    return None

"""The entries of the config list ``rewards``: what each kind takes, and what is wrong with an entry.

One key names the kind of an entry (exactly one of them):

* ``{function: "module:fn", weight, name, batch}``: a Python reward function. Per completion,
  ``fn(completion, reference) -> float`` (:mod:`grpo_dist.rewards.grading`), or TRL's batch form
  ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`` (:mod:`grpo_dist.rewards.batch`),
  recognised from the signature or forced with ``batch: true`` / ``batch: false``.
* ``{model: DIR_OR_HUB_ID, weight, name, batch_size, max_length}``: a sequence-classification reward model with one
  label (:mod:`grpo_dist.rewards.reward_model`).
* ``{url: "http://host:port/path", weight, name, timeout_s, max_retries}``: a remote scorer that gets the batch as
  JSON (:mod:`grpo_dist.rewards.remote`).

``weight`` defaults to 1.0; ``name`` (the metric suffix of ``reward/<name>`` and ``reward_errors/<name>``) defaults
to the function's name, the model directory's last part, or ``remote``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from grpo_dist.config.choices import MAX_REWARD_WEIGHT
from grpo_dist.config.errors import short

__all__ = ["KIND_KEYS", "reward_kind", "default_name", "reward_spec_problems", "model_dir_problems",
           "remote_time_problems"]

COMMON = ("weight", "name")
KIND_KEYS: dict[str, tuple[str, ...]] = {
    "function": ("function", *COMMON, "batch"),
    "model": ("model", *COMMON, "batch_size", "max_length"),
    "url": ("url", *COMMON, "timeout_s", "max_retries"),
}


def reward_kind(spec: dict) -> str:
    """'function', 'model' or 'url'; ValueError unless exactly one of those keys is present."""
    kinds = [k for k in KIND_KEYS if k in spec]
    if len(kinds) != 1:
        raise ValueError(f"reward spec {spec!r} needs exactly one of the keys function, model, url "
                         f"(got {', '.join(kinds) or 'none'})")
    return kinds[0]


def default_name(spec: dict) -> str:
    kind = reward_kind(spec)
    if spec.get("name"):
        return str(spec["name"])
    if kind == "function":
        return str(spec["function"]).split(":")[-1].strip()
    if kind == "model":
        return Path(str(spec["model"]).rstrip("/")).name or "reward_model"
    return "remote"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def reward_spec_problems(rewards: list) -> list[str]:
    """Every problem of the config list ``rewards`` (each names the key at fault)."""
    bad: list[str] = []
    shapes = ("{function: module:function, weight: float}, {model: DIR, weight: float} or "
              "{url: http://..., weight: float}")
    for i, r in enumerate(rewards):
        key = f"rewards[{i}]"
        if not isinstance(r, dict):
            bad.append(f"config key '{key}' must be {shapes}, got {short(r)}")
            continue
        try:
            kind = reward_kind(r)
        except ValueError:
            bad.append(f"config key '{key}' must have exactly one of function, model, url: {shapes}, got {short(r)}")
            continue
        unknown = sorted(set(r) - set(KIND_KEYS[kind]))
        if unknown:
            bad.append(f"unknown config key '{key}.{unknown[0]}' for a {kind} reward; allowed: "
                       f"{', '.join(KIND_KEYS[kind])}")
        w = r.get("weight", 1.0)
        if isinstance(w, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                w = float(w)
            except ValueError:
                pass
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or \
                abs(w) > MAX_REWARD_WEIGHT:
            bad.append(f"config key '{key}.weight' must be a finite number with |weight| <= "
                       f"{MAX_REWARD_WEIGHT:.0f}, got {short(w)}")
        if "name" in r and (not isinstance(r["name"], str) or not r["name"]):
            bad.append(f"config key '{key}.name' must be a non-empty string, got {short(r['name'])}")
        value = r[kind]
        if not isinstance(value, str) or not value.strip():
            bad.append(f"config key '{key}.{kind}' must be a non-empty string, got {short(value)}")
            continue
        if kind == "function":
            if value.count(":") != 1:
                bad.append(f"config key '{key}.function' must be 'module:function', got {short(value)}")
            if "batch" in r and not isinstance(r["batch"], bool):
                bad.append(f"config key '{key}.batch' must be true or false, got {short(r['batch'])}")
        elif kind == "model":
            for k in ("batch_size", "max_length"):
                if k in r and (not _is_int(r[k]) or r[k] < 1):
                    bad.append(f"config key '{key}.{k}' must be an integer >= 1, got {short(r[k])}")
            bad += model_dir_problems(f"{key}.model", value)
        else:
            if not value.startswith(("http://", "https://")):
                bad.append(f"config key '{key}.url' must start with http:// or https://, got {short(value)}")
            t = r.get("timeout_s")
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400):
                bad.append(f"config key '{key}.timeout_s' must be in (0, 86400] (seconds per request), got {short(t)}")
            m = r.get("max_retries", 2)
            if not _is_int(m) or not 0 <= m <= 10:
                bad.append(f"config key '{key}.max_retries' must be an integer in [0, 10], got {short(m)}")
    return bad


def remote_time_problems(rewards: list, reward_timeout_s: float, completions_per_rank: int,
                         collective_timeout_s: float) -> list[str]:
    """A remote scorer's worst call (every attempt cut at its deadline: timeout_s, by default reward_timeout_s x
    the rank's completions; plus the back-offs) must end before the other ranks, waiting in the next collective,
    time out: else one slow scorer kills the job as "rank N hung" instead of costing a step's rewards."""
    from grpo_dist.rewards.remote import worst_case_s
    bad = []
    for i, r in enumerate(rewards):
        if not isinstance(r, dict) or "url" not in r:
            continue
        per_request = r.get("timeout_s") or reward_timeout_s * completions_per_rank
        retries = r.get("max_retries", 2)
        worst = worst_case_s(per_request, retries)
        if worst >= collective_timeout_s:
            how = (f"{per_request:g} s" if r.get("timeout_s") else
                   f"reward_timeout_s {reward_timeout_s:g} s x {completions_per_rank} completions per rank = "
                   f"{per_request:g} s")
            attempts = f"{retries + 1} attempt{'s' if retries else ''}"
            bad.append(f"config key 'rewards[{i}].timeout_s': a request may take {how}, {attempts}: "
                       f"{worst:g} s, not below distributed.timeout_s = {collective_timeout_s:g} (the other ranks "
                       f"wait that long in the next collective); set rewards[{i}].timeout_s (per request) or "
                       f"max_retries lower, or raise distributed.timeout_s")
    return bad


def model_dir_problems(key: str, value: str) -> list[str]:
    """A reward model given as a local directory must hold a sequence-classification config with one label. A
    value that is not a local path is a Hub id: checked when it loads (grpo_dist.rewards.reward_model)."""
    p = Path(value).expanduser()
    if not p.exists():
        if value.startswith(("/", ".", "~")) or value.count("/") > 1:
            return [f"config key '{key}' = {value}: no such directory"]
        return []  # a Hub id
    if not p.is_dir():
        return [f"config key '{key}' = {value} is a file; give the reward model's directory"]
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        return [f"config key '{key}' = {value} has no config.json: not a Hugging Face model directory"]
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        return [f"config key '{key}' = {value}: cannot read config.json: {e}"]
    return classifier_problems(key, value, cfg.get("architectures") or [], _num_labels(cfg))


def _num_labels(cfg: dict) -> int:
    if isinstance(cfg.get("id2label"), dict):
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))  # transformers' default


def classifier_problems(key: str, value: str, architectures: list, num_labels: int) -> list[str]:
    bad = []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        bad.append(f"config key '{key}' = {value} is not a sequence-classification model (architectures "
                   f"{architectures or 'not given'}); a reward model is an AutoModelForSequenceClassification "
                   f"with num_labels=1")
    if num_labels != 1:
        bad.append(f"config key '{key}' = {value} has num_labels={num_labels}; a reward model scores with one "
                   f"label (num_labels=1)")
    return bad

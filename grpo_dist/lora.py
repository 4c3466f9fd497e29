"""LoRA (lora.r > 0): low-rank adapters injected into the policy with peft; only they are trained.

The policy stays the plain HF model class with peft's LoRA layers in place of the targeted Linear modules
(peft.inject_adapter_in_model, no PeftModel wrapper): FSDP (use_orig_params, frozen and trainable parameters in
one unit), the local engine, completion_logits and checkpoints see one ordinary module. Parameter names gain
`.base_layer.` and `.lora_A.default.` / `.lora_B.default.`.

- Reference model (beta > 0): the policy with its adapters scaled to 0 (`adapters_disabled`), no second model.
- Mixed precision: the adapters compute in the activations' dtype (`compute_in_input_dtype`); their master
  weights stay fp32 where the engine keeps fp32 masters (FSDP's MixedPrecision, DeepSpeed's optimizer).
- Generation replica: a plain copy of the model, refreshed with merged weights W + (alpha / r) B A (`merged`). An
  adapted tied head (lm_head in target_modules, tie_word_embeddings) is untied there and in merged/.
- Checkpoints: adapter_config.json + adapter_model.safetensors in peft's format (PeftModel.from_pretrained
  loads them onto the base model), and with lora.save_merged the merged HF model in merged/.
"""

from __future__ import annotations

import contextlib

import torch

ADAPTER = "default"  # peft's adapter name
_BASE = ".base_layer."
_PEFT_PREFIX = "base_model.model."  # how peft's saved adapters name the model's modules


def _peft_config(lcfg, base_name: str | None = None):
    from peft import LoraConfig
    return LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                      target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_name)


def apply_lora(model: torch.nn.Module, lcfg, init_seed: int) -> torch.nn.Module:
    """Inject adapters (in place) and freeze everything else. The adapter init draws from a generator seeded with
    init_seed, so every rank starts from the same adapters (B = 0: the first forward equals the base model)."""
    from peft import inject_adapter_in_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        try:
            inject_adapter_in_model(_peft_config(lcfg), model, adapter_name=ADAPTER)
        except ValueError as e:  # peft: target modules not found in the model
            from grpo_dist.config import ConfigError
            raise ConfigError(f"config key 'lora.target_modules' = {list(lcfg.target_modules)}: {e}") from None
    _refuse_embedding_targets(model, lcfg)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    compute_in_input_dtype(model)
    return model


def compute_in_input_dtype(model: torch.nn.Module) -> None:
    """peft casts a LoRA layer's input to lora_A's stored dtype. Under mixed precision that is the fp32 master
    weight while the engine computes the adapter in bf16/fp16 (FSDP unshards lora_A in the compute dtype only when
    lora_A itself runs): an fp32 input meets a bf16 weight. Off, the adapter computes in the dtype the activations
    already have, which is the engine's compute dtype on every engine (fp32 without mixed precision)."""
    from peft.tuners.lora import LoraLayer
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.cast_input_dtype_enabled = False


def _refuse_embedding_targets(model: torch.nn.Module, lcfg) -> None:
    """peft's embedding adapters (lora_embedding_A/B) are neither trained nor merged here: refuse them."""
    from peft.tuners.lora import LoraLayer
    hit = [n for n, m in model.named_modules()
           if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), torch.nn.Embedding)]
    if hit:
        from grpo_dist.config import ConfigError
        raise ConfigError(f"config key 'lora.target_modules' = {list(lcfg.target_modules)} adapts the embedding "
                          f"{hit[0]}: LoRA on embeddings is not supported (target Linear modules, lm_head included)")


def adapted_tied_weights(model: torch.nn.Module) -> list[str]:
    """Plain names of tied weights whose module carries an adapter (lm_head in target_modules of a model whose
    head is tied to its embeddings). Merged, that weight is W + s B A while its twin stays W: the plain model that
    holds the merge (the generation copy, merged/) must have them untied."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n.replace(_BASE, ".") for group in names.values() if len(group) > 1 for n in group if _BASE in n]


def untie(model: torch.nn.Module, names: list[str]) -> None:
    """Give each named parameter of a plain model storage of its own (see adapted_tied_weights)."""
    for name in names:
        owner, leaf = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        old = getattr(module, leaf)
        setattr(module, leaf, torch.nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
    config = getattr(model, "config", None)
    if names and config is not None:
        config.tie_word_embeddings = False  # nothing re-ties them (tie_weights, a save and reload)


def activate_dropout(model: torch.nn.Module) -> None:
    """The engines put the model in eval mode (no dropout anywhere); lora.dropout > 0 asks for dropout on the
    adapter input in the policy's forwards (the merged generation copy has none)."""
    for name, m in model.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER}"):
            m.train()


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def scaling(lcfg) -> float:
    return lcfg.alpha / lcfg.r


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model's forward: every LoRA layer adds 0 x its adapter's output. The adapters still run, so the
    reference pass executes the same modules in the same order as the policy's: FSDP's forward prefetch (and
    ZeRO-3's) replays the recorded order, and a prefetched adapter unit that never ran would stay unsharded (on
    NO_SHARD its parameters then vanish from named_parameters: the next weight sync failed with a KeyError).
    Not peft's disable_adapter_layers either: it flips requires_grad, which FSDP's flat parameters must not see
    mid-run. y + 0 * a is y exactly for a finite adapter output a, in any dtype."""
    from peft.tuners.lora import LoraLayer
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [dict(m.scaling) for m in layers]
    for m in layers:
        for k in m.scaling:
            m.scaling[k] = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            m.scaling.update(s)


class Reference(torch.nn.Module):
    """The reference model of a LoRA run: calls the policy with its adapters disabled."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: no second registration of the policy's parameters

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)


def merged(named: dict[str, torch.Tensor], s: float) -> dict[str, torch.Tensor]:
    """Full parameters of the adapted model (plain names) -> the plain model's parameters with the adapters
    merged: x.weight = x.base_layer.weight + s * x.lora_B.default.weight @ x.lora_A.default.weight.
    `named` must hold tied weights under all their names: an adapted tied head (lm_head.base_layer.weight is the
    embedding) is merged into its own lm_head.weight; an unadapted twin comes once, under its first name."""
    out = {}
    plain_ids = set()
    for name, t in named.items():
        if is_adapter_param(name):
            continue
        if _BASE not in name:
            if id(t) not in plain_ids:  # a tied twin (named_parameters(remove_duplicate=False)): once, first name
                out[name] = t
            plain_ids.add(id(t))
            continue
        prefix, leaf = name.split(_BASE)
        plain = f"{prefix}.{leaf}"
        if leaf == "weight":
            a, b = named[f"{prefix}.lora_A.{ADAPTER}.weight"], named[f"{prefix}.lora_B.{ADAPTER}.weight"]
            # summed in fp32 (DeepSpeed holds a bf16 base under mixed precision), kept in the wider dtype
            t = (t.float() + s * (b.float() @ a.float())).to(torch.promote_types(t.dtype, a.dtype))
        out[plain] = t
    return out


def adapter_state(model_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under peft's saved names (base_model.model.<module>.lora_A.weight)."""
    return {_PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v for k, v in model_sd.items() if is_adapter_param(k)}


def adapter_to_model_names(adapter_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of adapter_state."""
    out = {}
    for k, v in adapter_sd.items():
        k = k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k
        for part in ("lora_A", "lora_B"):
            k = k.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[k] = v
    return out


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_adapter_dir(path) -> bool:
    """A LoRA checkpoint: peft's adapter files (its base weights are the base model's, not in the directory)."""
    from pathlib import Path
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


@torch.no_grad()
def merge_saved_adapter(model: torch.nn.Module, adapter_dir) -> list[str]:
    """Merge a saved adapter (save_adapter's files) into a plain model in place: W += (alpha / r) B A for every
    adapted module, summed in fp32 as `merged` does; an adapted tied weight is untied first (adapted_tied_weights).
    Returns the names of the merged weights."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    conf = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    s = conf["lora_alpha"] / conf["r"]
    sd = adapter_to_model_names(load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)))
    prefixes = sorted({k.split(".lora_A.")[0] for k in sd if ".lora_A." in k})
    uses: dict[int, int] = {}
    for _, t in model.named_parameters(remove_duplicate=False):
        uses[id(t)] = uses.get(id(t), 0) + 1
    every = dict(model.named_parameters(remove_duplicate=False))
    untie(model, [f"{m}.weight" for m in prefixes if uses[id(every[f"{m}.weight"])] > 1])
    params = dict(model.named_parameters())
    for m in prefixes:
        w, a, b = params[f"{m}.weight"], sd[f"{m}.lora_A.{ADAPTER}.weight"], sd[f"{m}.lora_B.{ADAPTER}.weight"]
        w.copy_(w.float() + s * (b.float() @ a.float()))
    return [f"{m}.weight" for m in prefixes]


def save_adapter(out_dir, model_sd: dict[str, torch.Tensor], lcfg, base_name: str | None) -> None:
    """adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes them."""
    import json

    from safetensors.torch import save_file
    _peft_config(lcfg, base_name).save_pretrained(str(out_dir))
    # peft keeps target_modules as a set: its JSON order changes with the process's hash seed. Sorted, the same
    # run writes the same bytes (a resumed run's checkpoints equal the uninterrupted run's).
    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in adapter_state(model_sd).items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})

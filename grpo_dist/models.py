"""Models and tokenizers: load any HF causal LM, or build a tiny random one offline.

`tiny` models exist so that tests, CI and the CPU demo need no download: an architecture config (Qwen2, Llama,
Qwen3) with random weights seeded identically on every rank, and a tokenizer made on the spot (one token per
character, or a small byte-level BPE) or loaded from a local directory.
"""

from __future__ import annotations

import copy
import string
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from grpo_dist.config import TINY_DEFAULTS, ConfigError, ModelConfig, tiny_problems
from grpo_dist.config.choices import TRAINING_BACKENDS

# float64: CPU only (preflight.check_dtype_device), for runs whose numbers must not depend on the CPU's kernels
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# distributed.mixed_precision -> the compute dtype (FSDP MixedPrecision, the generation replica)
MIXED_PRECISION_DTYPES: dict[str | None, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reward_dtype(cfg) -> torch.dtype:
    """The compute dtype reward models run in (a GRPOConfig's): distributed.mixed_precision's, else model.dtype."""
    return MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision) or DTYPES[cfg.model.dtype]
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


# ---------------------------------------------------------------------------------------------------- tokenizers

def char_tokenizer(extra_tokens: int = 0) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (plus newline). `extra_tokens` pads the vocabulary with unused
    special tokens, so a model can have a bigger vocab (benchmarks) without ids the tokenizer cannot decode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>", padding_side="left")
    if extra_tokens > 0:
        hf.add_special_tokens({"additional_special_tokens": [f"<extra_{i}>" for i in range(extra_tokens)]})
    return hf


def bpe_tokenizer(vocab_size: int = 1024, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in a blink on a small built-in corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if corpus is None:
        words = ("the answer is what how many total each more than less sum of product difference number apples "
                 "she he they has have had buys sells gives left per day week dollars cost price half twice times "
                 "first second third final so we get therefore equals plus minus divided by multiplied").split()
        corpus = [f"{a} + {b} = {a + b}. {w} {words[(a * 7 + b) % len(words)]}"
                  for a in range(60) for b in range(40) for w in words[(a + b) % 5:(a + b) % 5 + 3]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="left")


def prepare_tokenizer(tok):
    """Left padding for generation, and a pad token (EOS when the tokenizer has none)."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token: completions could never end (model.tokenizer)")
    return tok


# -------------------------------------------------------------------------------------------------------- models

def _tiny_spec(cfg: ModelConfig) -> dict:
    assert cfg.tiny is not None  # called only for a tiny model
    bad = tiny_problems(cfg.tiny)  # GRPOConfig has checked them; a ModelConfig built alone has not
    if bad:
        raise ConfigError(bad[0], bad)
    return {**TINY_DEFAULTS, **cfg.tiny}


def build_tiny_tokenizer(cfg: ModelConfig):
    spec = _tiny_spec(cfg)
    kind = spec["tokenizer"]
    if kind == "char":
        base = char_tokenizer()
        extra = max(0, (spec["vocab_size"] or 0) - len(base))
        return char_tokenizer(extra) if extra else base
    if kind == "bpe":
        return bpe_tokenizer(spec["vocab_size"] or 1024)
    if Path(kind).is_dir():
        return AutoTokenizer.from_pretrained(kind, padding_side="left")
    raise ConfigError(f"config key 'model.tiny.tokenizer' = {kind!r}: use char, bpe or a tokenizer directory")


def build_tiny_model(cfg: ModelConfig, tokenizer) -> torch.nn.Module:
    """Random-init causal LM; the same weights on every rank because the seed is fixed before init."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    spec = _tiny_spec(cfg)
    arch = spec.pop("architecture")
    spec.pop("tokenizer")
    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}  # TINY_ARCHITECTURES
    vocab = max(spec.pop("vocab_size") or 0, len(tokenizer))
    kwargs = dict(spec, vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if arch == "qwen3":
        kwargs.setdefault("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    config = classes[arch](**kwargs)
    if cfg.attn_implementation:
        config._attn_implementation = cfg.attn_implementation
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.init_seed)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                               bos_token_id=tokenizer.bos_token_id)
    return model


def load_tokenizer(cfg: ModelConfig):
    if cfg.name_or_path is None and cfg.tokenizer is None:
        if cfg.tiny is None:
            raise ConfigError("set 'model.name_or_path' (an HF model) or 'model.tiny' (a random model to build)")
        return prepare_tokenizer(build_tiny_tokenizer(cfg))
    src = cfg.tokenizer or cfg.name_or_path
    with _named_source("model.tokenizer" if cfg.tokenizer else "model.name_or_path", src):
        tok = AutoTokenizer.from_pretrained(src, padding_side="left", trust_remote_code=cfg.trust_remote_code)
    return prepare_tokenizer(tok)


@contextmanager
def _named_source(key: str, value: str | None):
    """transformers' OSError for a missing repo / no connection / missing files, as one line naming the key."""
    try:
        yield
    except OSError as e:
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"config key '{key}' = {value}: cannot load it: {first}") from None


def load_on_rank0_only(cfg, world_size: int) -> bool:
    """Whether rank 0 alone reads pretrained weights and the other ranks build on the meta device and receive
    rank 0's values (host RAM then holds about one model copy per node during loading, not one per rank, and the
    files are read once). FSDP fills the meta ranks while it wraps, FSDP2 by one broadcast per tensor, DeepSpeed by
    a broadcast before deepspeed.initialize (fill_from_rank0). Same answer on every rank. Tiny random models are
    seeded identically on every rank and need none of it."""
    return (cfg.model.name_or_path is not None and world_size > 1
            and cfg.distributed.backend in TRAINING_BACKENDS)  # every engine fills from rank 0


def fill_from_rank0(model: torch.nn.Module, device) -> torch.nn.Module:
    """Every rank's parameters and buffers take rank 0's values, in place, on `device` (meta-built ranks get
    storage there first). Collective: every rank passes the same architecture, so the same tensors in the same
    order."""
    from grpo_dist import distributed as gdist
    materialize_meta(model, device)
    gdist.broadcast_tensors([t.data for t in [*model.parameters(), *model.buffers()]])  # tied: listed once
    return model


def materialize_meta(model: torch.nn.Module, device) -> torch.nn.Module:
    """Put every parameter and buffer of a meta-built model on `device`: meta tensors get real (uninitialised)
    storage there, real buffers (empty-weight init computes e.g. RoPE's inv_freq on the CPU) are moved there with
    their values. Parameter values must come from elsewhere (a broadcast, copy_weights_to); a buffer that was meta
    needs a broadcast too. A buffer left behind would be on the CPU of a GPU rank: the first rollout would index a
    CPU table with CUDA positions."""
    device = torch.device(device)
    made: dict[int, torch.Tensor] = {}  # tied weights (embeddings = lm_head) and shared buffers stay shared
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                     requires_grad=p.requires_grad)
                setattr(module, name, made[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if id(b) not in made:
                made[id(b)] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)
            module._buffers[name] = made[id(b)]
    return model


def misplaced_tensors(model: torch.nn.Module, device) -> list[str]:
    """'parameter|buffer NAME on DEVICE' for every tensor of `model` that is not on `device` (a meta tensor never
    is): empty when everything is where the rank computes."""
    want = torch.device(device)
    out = []
    for kind, items in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
                out.append(f"{kind} {name} on {t.device}")
    return out


def load_model(cfg: ModelConfig, tokenizer, on_meta: bool = False) -> torch.nn.Module:
    """The policy (or a reference copy): pretrained when name_or_path is set, else a tiny random model.
    on_meta: the architecture only, parameters on the meta device (no weights read, no memory), buffers real."""
    if cfg.name_or_path is None:
        if cfg.tiny is None:
            raise ConfigError("set 'model.name_or_path' (an HF model) or 'model.tiny' (a random model to build)")
        return build_tiny_model(cfg, tokenizer)
    kwargs = dict(dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code)
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if on_meta:
        from accelerate import init_empty_weights
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
        with init_empty_weights():  # include_buffers=False: rotary inv_freq etc. are computed for real
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        model.tie_weights()  # from_config under init_empty_weights leaves lm_head untied; rank 0's model is tied
        try:
            model.generation_config = GenerationConfig.from_pretrained(cfg.name_or_path)
        except OSError:
            pass
    else:
        with _named_source("model.name_or_path", cfg.name_or_path):
            model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def copy_in_dtype(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A deep copy of `model` whose parameters are created directly in `dtype` (None: their own dtype), never as a
    full copy at the source dtype first: a 7B fp32 policy deep-copied before a bf16 cast would briefly need 28 GB
    more on the GPU. Buffers are copied as they are (RoPE's inv_freq stays fp32, as FSDP's MixedPrecision keeps
    it); tied parameters stay one parameter; the copy never shares storage with the source."""
    memo: dict = {}
    for p in model.parameters():  # tied weights are listed once, so they map to one new parameter
        memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def cast_parameters_(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Parameters to `dtype` in place (None: unchanged); buffers keep theirs (see copy_in_dtype)."""
    if dtype is not None:
        for p in model.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def decoder_layer_classes(model: torch.nn.Module) -> set[type]:
    """The transformer block classes FSDP wraps one by one (from the model's own _no_split_modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"cannot find the decoder layer class of {type(model).__name__} for FSDP auto-wrapping")
    return found

"""A stand-in for vLLM's `LLM`, for CPU tests of rollout_engines.VLLMRolloutEngine where vLLM is not importable.

It takes the calls the engine makes and keeps the state that matters to them: whether the weights in its memory
are usable (loaded from the directory, or synced) or garbage (load_format="dummy", or freed by a level-2 sleep:
wake_up brings the buffers back, not their contents), every call in order (`events`), and the tokens it sampled.
Like vLLM it reseeds the process RNGs (torch, numpy, random) when it is built, and samples from the process's
torch RNG. Greedy completions are a fixed function of the prompt: `greedy_length(prompt ids)` tokens, then EOS.
install() puts it in sys.modules as `vllm` (and `vllm.inputs`)."""

from __future__ import annotations

import importlib.machinery
import random
import sys
import types

import numpy as np
import torch

FIRST_TOKEN, VOCAB = 4, 100  # ordinary ids of grpo_dist.models.char_tokenizer (0-3 are special)
USABLE = ("loaded", "synced")


def greedy_length(prompt_ids, max_tokens: int) -> int:
    return sum(prompt_ids) % max_tokens


class Logprob:
    def __init__(self, logprob: float):
        self.logprob = logprob


class Completion:
    def __init__(self, index: int, token_ids: list[int]):
        self.index, self.token_ids = index, token_ids
        self.logprobs = [{t: Logprob(-1.0)} for t in token_ids]


class RequestOutput:
    def __init__(self, outputs: list[Completion]):
        self.outputs = outputs


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def TokensPrompt(prompt_token_ids):  # noqa: N802  (vLLM's name)
    return {"prompt_token_ids": list(prompt_token_ids)}


class _Model:
    def __init__(self, llm):
        self.llm = llm

    def load_weights(self, weights):
        self.llm._take(weights, "load_weights")


class _Worker:
    def __init__(self, llm):
        self.model_runner = types.SimpleNamespace(get_model=lambda: _Model(llm))


class LLM:
    built: list = []  # the engines built in this process, in order
    reload_takes_iterator = True  # False: a vLLM whose reload_weights takes no arguments (before the layerwise one)

    def __init__(self, model, seed=0, **kwargs):
        torch.manual_seed(seed)  # what vLLM's constructor does to the process RNGs
        random.seed(seed)
        np.random.seed(seed)
        self.kwargs = dict(model=model, seed=seed, **kwargs)
        self.weights = "dummy" if kwargs.get("load_format") == "dummy" else "loaded"
        self.kv_cache = True
        self.events: list[tuple] = []
        self.synced: dict[str, torch.Tensor] = {}
        self.sampled: list[list[list[int]]] = []  # per generate call: the token ids of every completion
        self.llm_engine = types.SimpleNamespace(engine_core=None)
        LLM.built.append(self)

    def sleep(self, level: int = 1):
        self.events.append(("sleep", level))
        if level == 2:
            self.weights = "released"
        self.kv_cache = False

    def wake_up(self, tags=None):
        tags = tuple(tags) if tags else ("weights", "kv_cache")
        self.events.append(("wake_up", tags))
        if "kv_cache" in tags:
            self.kv_cache = True

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))

    def collective_rpc(self, method, kwargs=None):
        kwargs = kwargs or {}
        if callable(method):
            method(_Worker(self), **kwargs)
            return [None]
        assert method == "reload_weights", method
        if not LLM.reload_takes_iterator:
            raise TypeError("Worker.reload_weights() got an unexpected keyword argument 'weights_iterator'")
        assert kwargs["is_checkpoint_format"] is True
        self._take(kwargs["weights_iterator"], "reload_weights")
        return [None]

    def _take(self, weights, how: str):
        self.synced = {name: t.detach().clone() for name, t in weights}
        self.weights = "synced"
        self.events.append((how, len(self.synced)))

    def generate(self, prompts, params, use_tqdm=False):
        self.events.append(("generate", self.weights, self.kv_cache))
        out, sampled = [], []
        eos = params.stop_token_ids[0]
        for p in prompts:
            ids = p["prompt_token_ids"]
            completions = []
            for j in range(params.n):
                if params.temperature == 0:
                    n = greedy_length(ids, params.max_tokens)
                    tokens = [FIRST_TOKEN + (sum(ids) + k) % (VOCAB - FIRST_TOKEN) for k in range(n)]
                    tokens += [eos] if n < params.max_tokens else []
                else:  # the process's torch RNG, as vLLM's sampler draws from it
                    tokens = torch.randint(FIRST_TOKEN, VOCAB, (params.max_tokens,)).tolist()
                completions.append(Completion(j, tokens))
                sampled.append(tokens)
            out.append(RequestOutput(completions))
        self.sampled.append(sampled)
        return out


def install() -> types.ModuleType:
    """The fake as `vllm` in sys.modules (importlib.util.find_spec finds it there too)."""
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.__version__ = "0.0.fake"
    inputs = types.ModuleType("vllm.inputs")
    inputs.__spec__ = importlib.machinery.ModuleSpec("vllm.inputs", None)
    inputs.TokensPrompt = TokensPrompt
    vllm.LLM, vllm.SamplingParams, vllm.inputs = LLM, SamplingParams, inputs
    sys.modules["vllm"], sys.modules["vllm.inputs"] = vllm, inputs
    return vllm


def save_tiny_model(path, seed: int = 0):
    """A tiny random Qwen2 causal LM with the char tokenizer, saved as an HF directory (what rollout_engine=vllm
    needs: model.name_or_path)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_dist.models import char_tokenizer
    tok = char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)

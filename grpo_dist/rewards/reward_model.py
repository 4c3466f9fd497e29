"""Reward models: ``rewards: [{model: DIR_OR_HUB_ID, weight: w, batch_size: 8, max_length: null}]``.

The model is an ``AutoModelForSequenceClassification`` with ``num_labels=1`` and its tokenizer, both loaded from
the same directory (or Hub id) once per rank, in the trainer process (never in the grading workers), on the rank's
device and in the compute dtype (distributed.mixed_precision's, else model.dtype). Anything else is refused at
start, naming the key (exit 2): a missing directory, a model that is not a sequence classifier, one with more than
one label.

The score of a completion is the model's single logit on the prompt and the completion::

    text_i  = tokenizer.apply_chat_template([{"role": "user", "content": prompt_i},
                                             {"role": "assistant", "content": completion_i}], tokenize=False)
              if the reward model's tokenizer has a chat template (its special tokens come from the template),
              else prompt_i + completion_i (the tokenizer adds its special tokens)
    score_i = model(**tokenizer(text_i)).logits[0, 0]

where prompt_i is the problem text of the row (see grpo_dist.rewards.batch; a message list in conversational mode
is used as the conversation's first turns). Texts are scored batch_size at a time, padded (the classifier reads the
last non-pad token, so padding does not change a score beyond float rounding) and, with max_length, truncated from
the left to max_length tokens. A forward that fails makes every item of that call an error (reward_errors/<name>).
"""

from __future__ import annotations

import traceback

import torch

from grpo_dist.config import ConfigError
from grpo_dist.rewards.specs import classifier_problems

__all__ = ["RewardModelScorer"]


class RewardModelScorer:
    def __init__(self, source: str, key: str = "rewards[0].model", device=None, dtype=None, batch_size: int = 8,
                 max_length: int | None = None):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        self.source, self.key = source, key
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.batch_size, self.max_length = int(batch_size), max_length
        try:
            config = AutoConfig.from_pretrained(source)
        except Exception as e:  # noqa: BLE001 - missing, unreachable offline, not a model directory
            raise ConfigError(f"config key '{key}' = {source}: cannot load the reward model's config: "
                              f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") \
                from None
        bad = classifier_problems(key, source, list(getattr(config, "architectures", None) or []),
                                  int(getattr(config, "num_labels", 2)))
        if bad:
            raise ConfigError(bad[0], bad)
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype or torch.float32)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self.chat = getattr(self.tokenizer, "chat_template", None) is not None

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        if not self.chat:
            return [(p if isinstance(p, str) else " ".join(str(m.get("content", "")) for m in p)) + c
                    for p, c in zip(prompts, completions)]
        out = []
        for p, c in zip(prompts, completions):
            turns = list(p) if isinstance(p, list) else [{"role": "user", "content": p}]
            text = self.tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": c}], tokenize=False)
            out.append(text if isinstance(text, str) else str(text))
        return out

    @torch.no_grad()
    def forward(self, texts: list[str]) -> list[float]:
        scores: list[float] = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[s:s + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length,
                                 add_special_tokens=not self.chat)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores

    def score(self, batch) -> tuple[list, list]:
        from grpo_dist.rewards.batch import check_batch_result
        n = len(batch)
        if n == 0:
            return [], []
        prompts = batch.prompts if len(batch.prompts) == n else [""] * n
        try:
            values = self.forward(self.texts(prompts, list(batch.completions)))
        except Exception:  # noqa: BLE001 - counted as n errors by the caller
            return [0.0] * n, ["raised " + traceback.format_exc(limit=8)[-4000:]] * n
        return check_batch_result(values, n)

    def close(self) -> None:
        self.model = None

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

with the prompt's and the completion's text tokenized as text, never as control tokens: a completion spelling
`<|im_end|>\n<|im_start|>user` is those characters, not the end of the assistant's turn and a fake user turn in
the judge's input (grpo_dist.data.prompts.chat_prompt / encode_prompts, as for the policy's prompts; texts that
spell no special token tokenize exactly as tokenizer(text_i)). A chat template that rewrites such a text so that it
cannot be kept apart makes that completion an error (reward_errors/<name>), not the others of the call.

where prompt_i is the problem text of the row (see grpo_dist.rewards.batch; a message list in conversational mode
is used as the conversation's first turns). Texts are scored batch_size at a time, padded (the classifier reads the
last non-pad token, so padding does not change a score beyond float rounding) and, with max_length, truncated from
the left to max_length tokens. A forward that fails makes every item of that call an error (reward_errors/<name>).
"""

from __future__ import annotations

import traceback

import torch

from grpo_dist.config.errors import ConfigError
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
        """The judge's input of each row as text (for logs and display): render()'s text."""
        return [r if isinstance(r, str) else r.text for r in self.render(prompts, completions)[0]]

    def render(self, prompts: list, completions: list[str]) -> tuple[list, list]:
        """(each row's input: a str of row text only, or a RenderedPrompt of the chat template, None where the
        template alters the row's text; each row's error or None)."""
        if not self.chat:
            return [(p if isinstance(p, str) else " ".join(str(m.get("content", "")) for m in p)) + c
                    for p, c in zip(prompts, completions)], [None] * len(completions)
        from grpo_dist.data import DataError
        from grpo_dist.data.chat_template import chat_prompt
        out: list = []
        errors: list = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            turns = list(p) if isinstance(p, list) else [{"role": "user", "content": p}]
            rows = [m["content"] for m in turns if isinstance(m.get("content"), str)] + [c]

            def messages(texts: list[str], turns=turns) -> list[dict]:
                it = iter(texts)
                return [dict(m, content=next(it)) if isinstance(m.get("content"), str) else m for m in turns] + \
                    [{"role": "assistant", "content": next(it)}]
            try:
                out.append(chat_prompt(self.tokenizer, messages, rows, [], i, generation_prompt=False))
                errors.append(None)
            except DataError as e:
                out.append(None)
                errors.append(f"the reward model's chat template alters the completion's text, which spells a "
                              f"special token, so it cannot be kept as text ({e})")
        return out, errors

    def encode(self, rendered: list) -> list[list[int]]:
        """Token ids, cut to max_length from the left: the chat template's special tokens parsed, row text as text
        (split_special_tokens); without a chat template the tokenizer adds its own special tokens around it."""
        from grpo_dist.data.prompts import encode_prompts
        if not self.chat:  # the tokenizer cuts from the left (truncation_side) and keeps its special tokens
            return [list(ids) for ids in self.tokenizer(rendered, add_special_tokens=True, split_special_tokens=True,
                                                        truncation=self.max_length is not None,
                                                        max_length=self.max_length)["input_ids"]]
        ids = encode_prompts(self.tokenizer, rendered)
        return ids if self.max_length is None else [x[-self.max_length:] for x in ids]  # from the left

    @torch.no_grad()
    def forward(self, rendered: list) -> list[float]:
        scores: list[float] = []
        for s in range(0, len(rendered), self.batch_size):
            ids = self.encode(rendered[s:s + self.batch_size])
            padded = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in padded.items()}
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores

    def score(self, batch) -> tuple[list, list]:
        from grpo_dist.rewards.batch import check_batch_result
        n = len(batch)
        if n == 0:
            return [], []
        prompts = batch.prompts if len(batch.prompts) == n else [""] * n
        try:
            rendered, errors = self.render(prompts, list(batch.completions))
            ok = [i for i in range(n) if errors[i] is None]
            values = self.forward([rendered[i] for i in ok])
        except Exception:  # noqa: BLE001 - counted as n errors by the caller
            return [0.0] * n, ["raised " + traceback.format_exc(limit=8)[-4000:]] * n
        checked, checked_errors = check_batch_result(values, len(ok))
        scores: list = [0.0] * n
        for j, i in enumerate(ok):
            scores[i], errors[i] = checked[j], checked_errors[j]
        return scores, errors

    def close(self) -> None:
        self.model = None

"""Held-out accuracy with the Python tool in the loop, and what the tool did (docs/tools.md).

    python bench/tool_math.py MODEL_DIR [--config configs/tool_math_cpu.yaml] [--limit 40] [key=value ...]

Greedy episodes (the config's environment section: the sandbox runs the calls) on the first --limit held-out
problems of the config's data; prints accuracy (the first reward function gives full marks; and, next to it, the
share that math_reward's "The final answer is N" line grades right), tool calls, turns and tool errors per episode,
and one episode as an example (--show N: the first N)."""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--config", default="configs/tool_math_cpu.yaml")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--show", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    from transformers import AutoModelForCausalLM

    from grpo_dist.config import load_config
    from grpo_dist.data import load_examples, render_prompt
    from grpo_dist.environments import build_environment
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rewards.grading import resolve_reward_function
    from grpo_dist.rollout import eos_token_ids
    from grpo_dist.rollout_engines import ReplicaRolloutEngine, SamplingSpec
    cfg = load_config(a.config, [f"model.name_or_path={a.model_dir}", *a.overrides])
    tok = load_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.float32).eval()
    env = build_environment(cfg, tok)
    examples = load_examples(cfg.data, "eval")[:a.limit]
    prompts = [render_prompt(e, cfg.data, tok) for e in examples]
    spec = SamplingSpec(n=1, max_tokens=cfg.max_completion_length, eos_ids=tuple(eos_token_ids(model, tok)),
                        greedy=True)
    t0 = time.perf_counter()
    batch = env.rollout(ReplicaRolloutEngine(model, True, tok.pad_token_id), tok, prompts,
                        [e.answer for e in examples], spec, cfg.data.max_prompt_length, "cpu")
    grade = resolve_reward_function(cfg.rewards[0]["function"] if isinstance(cfg.rewards[0], dict)
                                    else cfg.rewards[0].function)
    correct = [float(grade(c, e.answer)) >= 1.0 for c, e in zip(batch.completions, examples)]
    # the project's strict grader too (it wants "The final answer is N"), whatever the config grades with
    strict_grade = resolve_reward_function("grpo_dist.rewards:evaluated_math_reward")
    strict = [float(strict_grade(c, e.answer)) >= 1.0 for c, e in zip(batch.completions, examples)]
    c = env.take_counts()
    n = max(1, c["episodes"])
    observed = int((batch.tool_mask.sum(-1) < batch.completion_mask.sum(-1)).sum())
    print(f"accuracy {100 * sum(correct) / len(correct):.1f} % of {len(correct)} (math_reward's answer line: "
          f"{100 * sum(strict) / len(strict):.1f} %) | tool calls/episode "
          f"{c['tool_calls'] / n:.2f} | episodes with an observation {observed}/{n} | turns/episode "
          f"{c['turns'] / n:.2f} | tool errors {c['tool_errors']} (timeouts {c['tool_timeouts']}) | cut by "
          f"max_turns {c['cut_max_turns']} | {time.perf_counter() - t0:.0f} s")
    for text in batch.completions[:a.show]:
        print("example episode:\n" + text)


if __name__ == "__main__":
    main()

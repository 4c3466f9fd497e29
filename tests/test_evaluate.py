"""grpo_dist.evaluation: the pass@k estimator against its written-out definition, and the CLI grpo_dist.tools.evaluate
under torchrun (2 ranks split the problems and reduce) against the same evaluation in one process."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_dist.evaluation import k_values, pass_at_k

pytestmark = pytest.mark.fast  # the `make fast` tier

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n,c,k", [(8, 0, 1), (8, 1, 1), (8, 3, 2), (8, 3, 8), (8, 8, 4), (16, 5, 4), (10, 9, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    # Definition (Chen et al. 2021): pass@k = 1 - C(n-c, k) / C(n, k)
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    if n <= 10:
        # ... which is the fraction of the k-subsets of the n samples that contain a correct one.
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(samples[i] for i in s) for s in subsets) / len(subsets))


def test_pass_at_k_edges():
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 = mean accuracy of the samples
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]


@pytest.mark.slow  # torchrun with 2 ranks, then 1 process: ~20 s
def test_cli_two_ranks_match_one_process(tmp_path):
    """torchrun x2 runs `python -m grpo_dist.tools.evaluate` on an odd number of problems; its greedy accuracy and count
    must equal one in-process evaluation of the same model (ranks take every other problem and sum)."""
    from grpo_dist.config import ModelConfig, load_config
    from grpo_dist.data import load_examples
    from grpo_dist.distributed import DistContext
    from grpo_dist.evaluation import evaluate
    from grpo_dist.models import build_tiny_model, build_tiny_tokenizer, load_model, load_tokenizer
    from grpo_dist.rewards import RewardComputer

    mcfg = ModelConfig(tiny=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64), init_seed=3)
    tok = build_tiny_tokenizer(mcfg)
    model_dir = tmp_path / "model"
    build_tiny_model(mcfg, tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)}) + "\n"
                            for a in range(11)))
    cfg_path = tmp_path / "eval.yaml"
    cfg_path.write_text("max_completion_length: 3\nreward_workers: 0\n"
                        "rewards: [{function: 'reward_fns:char_parity', weight: 1.0}]\n")

    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "grpo_dist.tools.evaluate",
           "--model", str(model_dir), "--data", str(data), "--config", str(cfg_path), "--num-samples", "4",
           "--output", str(tmp_path / "result.json"), "--completions", str(tmp_path / "completions.jsonl")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "result.json").read_text())["accuracy"] == last["accuracy"]
    assert last["num_examples"] == 11
    assert {"pass@1", "pass@2", "pass@4"} <= set(last)
    assert last["pass@1"] <= last["pass@2"] <= last["pass@4"] <= 1.0

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        cfg = load_config(cfg_path, [f"model.name_or_path={model_dir}", f"data.eval_path={data}"])
        tokenizer = load_tokenizer(cfg.model)
        model = load_model(cfg.model, tokenizer)
        records = []
        with RewardComputer(cfg.rewards, num_workers=0) as rewards:
            one = evaluate(model, tokenizer, load_examples(cfg.data, "eval"), cfg,
                           DistContext(0, 1, 0, torch.device("cpu"), "gloo"), rewards, records=records)
    finally:
        sys.path.remove(str(ROOT / "tests"))
    assert one["num_examples"] == 11
    assert one["accuracy"] == pytest.approx(last["accuracy"])
    assert 0.0 < one["accuracy"] < 1.0  # a real mix, so a wrong split or reduction would show

    # --completions: both ranks' greedy completions, gathered in problem order, the same as one process makes;
    # their correct / truncated flags add up to the reported accuracy and truncated fraction.
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(11))
    assert [r["problem"] for r in rows] == [f"{a}+{a + 1}=" for a in range(11)]
    assert [(r["completion"], r["correct"], r["truncated"]) for r in rows] == \
        [(r["completion"], r["correct"], r["truncated"]) for r in records]
    assert sum(r["correct"] for r in rows) / 11 == pytest.approx(last["accuracy"])
    assert sum(r["truncated"] for r in rows) / 11 == pytest.approx(last["truncated_fraction"])
    assert one["truncated_fraction"] == pytest.approx(last["truncated_fraction"])
    for r in rows:  # cut off = no EOS, so it used every allowed token; an answer that stopped used fewer or as many
        assert r["num_tokens"] == 3 if r["truncated"] else 1 <= r["num_tokens"] <= 3

@pytest.mark.heavy  # a 1-step training run, then 3 evaluation processes: ~14 s; out of `make fast`
def test_output_dir_without_config_uses_the_runs_config(tmp_path):
    """A run trained with its own reward function (here: always full marks) is evaluated with that function when
    --model is its output_dir or a checkpoint and no --config is given; the defaults (math_reward) would give 0 for
    a tiny random model."""
    import json as _json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH",
                                                                                                       "")]))
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}",
                    "max_steps=1", "save_steps=0", "reward_workers=0", "progress_bar=false",
                    "rewards=[{function: 'reward_fns:always_one'}]"], cwd=root, env=env, check=True,
                   capture_output=True, timeout=300)
    for model in (out, out / "checkpoint-1"):
        r = subprocess.run([sys.executable, "-m", "grpo_dist.tools.evaluate", "--model", str(model), "--limit", "4",
                            "reward_workers=0"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert _json.loads(r.stdout.splitlines()[-1])["accuracy"] == 1.0
        assert "using the training run's config" in r.stderr
    r = subprocess.run([sys.executable, "-m", "grpo_dist.tools.evaluate", "--model", str(out), "--limit", "4",
                        "--config", "configs/smoke_cpu.yaml", "reward_workers=0"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert _json.loads(r.stdout.splitlines()[-1])["accuracy"] == 0.0  # an explicit --config still wins


def test_saved_adapter_merged_into_the_base_computes_the_adapted_model(tmp_path):
    """merge_saved_adapter (evaluate's base + adapter path): W + (alpha / r) B A into a fresh base model, the tied
    head untied, gives the logits of the adapted model that wrote the adapter."""
    from grpo_dist import lora
    from grpo_dist.config import load_config
    from grpo_dist.models import build_tiny_model, build_tiny_tokenizer
    cfg = load_config(None, ["model.tiny={architecture: llama, hidden_size: 32, num_hidden_layers: 1, "
                             "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64, "
                             "tie_word_embeddings: true}", "lora.r=4", "lora.alpha=8",
                             "lora.target_modules=[q_proj, down_proj, lm_head]"])
    tok = build_tiny_tokenizer(cfg.model)
    adapted = lora.apply_lora(build_tiny_model(cfg.model, tok), cfg.lora, 0).eval()
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    lora.save_adapter(tmp_path, adapted.state_dict(), cfg.lora, None)
    base = build_tiny_model(cfg.model, tok).eval()
    ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        assert sorted(lora.merge_saved_adapter(base, tmp_path)) == [
            "lm_head.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
        assert base.lm_head.weight is not base.model.embed_tokens.weight
        want, got = adapted(input_ids=ids).logits, base(input_ids=ids).logits
    assert (want - before).abs().max() > 1e-2  # the adapter matters
    assert (want - got).abs().max() < 1e-5


@pytest.mark.slow  # a 1-step LoRA run, then 4 evaluations: ~40 s
def test_lora_run_is_evaluated_with_its_config_from_merged_or_base_plus_adapter(tmp_path):
    """--model of a LoRA run (output_dir, checkpoint, or its merged/) evaluates the trained model with the run's own
    config (reward always_one: accuracy 1; the defaults give 0); without merged/ the base model + adapter gives the
    same greedy completions as merged/."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH",
                                                                                                       "")]))
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}",
                    "max_steps=1", "save_steps=0", "reward_workers=0", "progress_bar=false", "lora.r=4",
                    "lora.save_merged=true", "learning_rate=0.05", "rewards=[{function: 'reward_fns:always_one'}]"],
                   cwd=root, env=env, check=True, capture_output=True, timeout=300)

    def evaluate(model, completions):
        r = subprocess.run([sys.executable, "-m", "grpo_dist.tools.evaluate", "--model", str(model), "--limit", "6",
                            "--completions", str(completions), "reward_workers=0"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout.splitlines()[-1])["accuracy"] == 1.0
        assert "using the training run's config" in r.stderr
        return completions.read_text()

    ckpt = out / "checkpoint-1"
    merged = [evaluate(m, tmp_path / f"c{i}.jsonl") for i, m in enumerate((out, ckpt, ckpt / "merged"))]
    assert merged[0] == merged[1] == merged[2]
    # the same checkpoint as a run without lora.save_merged writes it: no merged/, its manifest without it
    # (evaluate verifies the manifest, so merged/ cannot just be deleted)
    from grpo_dist.checkpoint import _describe, _write_manifest_file
    from grpo_dist.manifest import files_on_disk
    (ckpt / "merged").rename(tmp_path / "merged_aside")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["config"]["lora"]["save_merged"] = False
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _write_manifest_file(ckpt, _describe(ckpt, files_on_disk(ckpt)))
    assert evaluate(ckpt, tmp_path / "base_plus_adapter.jsonl") == merged[0]

"""Reward models (grpo_dist.rewards.reward_model): a tiny random sequence classifier with one label, saved offline
with its tokenizer, scores prompt + completion exactly as a direct forward of the model on the same text; what is
not such a classifier is refused at start, naming the key."""

import pytest
import torch

from helpers import save_classifier

pytestmark = pytest.mark.fast

PROMPTS = ["3+4=", "3+4=", "10+2=", "10+2="]
COMPLETIONS = ["7", "seven<eos>", "12 is it", ""]
CHAT = ("{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return str(save_classifier(tmp_path_factory.mktemp("rm") / "tiny_rm"))


def direct_scores(path, texts, add_special_tokens=True):
    """score_i = model(**tokenizer(text_i)).logits[0, 0], one text at a time, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0, 0])
                for t in texts]


def test_scores_equal_a_direct_forward(rm_dir):
    from grpo_dist.rewards import RewardComputer
    specs = [{"model": rm_dir, "weight": 2.0, "batch_size": 3}, {"function": "reward_fns:odd_length"}]
    with RewardComputer(specs, num_workers=0) as rc:
        totals, per_fn = rc(COMPLETIONS, ["7", "7", "12", "12"], prompts=PROMPTS)
    want = direct_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert len(set(want)) == 4  # the texts differ, and so do their scores
    assert per_fn["tiny_rm"] == pytest.approx(want, abs=1e-5)  # batched, padded: the same up to rounding
    assert totals == pytest.approx([2 * w + len(c) % 2 for w, c in zip(want, COMPLETIONS)], abs=1e-5)
    assert rc.last_errors == {"tiny_rm": 0, "odd_length": 0}


def test_chat_template_of_the_reward_model(tmp_path):
    from grpo_dist.rewards import RewardComputer
    path = str(save_classifier(tmp_path / "chat_rm", chat_template=CHAT))
    with RewardComputer([{"model": path}], num_workers=0) as rc:
        _, per_fn = rc(COMPLETIONS[:2], ["7", "7"], prompts=PROMPTS[:2])
    texts = [f"<bos>user:{p}\n<bos>assistant:{c}\n" for p, c in zip(PROMPTS, COMPLETIONS[:2])]
    assert per_fn["chat_rm"] == pytest.approx(direct_scores(path, texts, add_special_tokens=False), abs=1e-5)


def test_not_a_one_label_classifier_is_refused(tmp_path, rm_dir, capsys):
    from grpo_dist.config import ConfigError, load_config, main
    from grpo_dist.rewards.reward_model import RewardModelScorer
    two = str(save_classifier(tmp_path / "two_labels", num_labels=2))
    assert main(["--check", "none", f"rewards=[{{model: '{two}'}}]"]) == 2
    err = capsys.readouterr().err
    assert "'rewards[0].model'" in err and "num_labels=2" in err, err
    with pytest.raises(ConfigError, match=r"rewards\[1\].model.*no such directory"):
        load_config(None, [f"rewards=[{{model: '{rm_dir}'}}, {{model: '{tmp_path}/missing'}}]"])
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardModelScorer(two)
    causal = tmp_path / "causal"
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).save_pretrained(causal)
    with pytest.raises(ConfigError, match="not a sequence-classification model"):
        load_config(None, [f"rewards=[{{model: '{causal}'}}]"])


def test_forward_failure_counts_every_item(rm_dir, capfd):
    from grpo_dist.rewards import RewardComputer
    with RewardComputer([{"model": rm_dir, "max_length": 4}, "reward_fns:odd_length"], num_workers=0) as rc:
        rc._batch["tiny_rm"].model.forward = None  # a forward that raises
        totals, _ = rc(COMPLETIONS, ["7"] * 4, prompts=PROMPTS)
    assert rc.last_errors == {"tiny_rm": 4, "odd_length": 0}
    assert totals == [float(len(c) % 2) for c in COMPLETIONS]
    assert "reward function 'tiny_rm'" in capfd.readouterr().err


def test_loaded_in_the_compute_dtype_on_the_given_device(rm_dir):
    from grpo_dist.rewards import RewardComputer
    with RewardComputer([{"model": rm_dir}], num_workers=0, device="cpu", dtype=torch.bfloat16) as rc:
        model = rc._batch["tiny_rm"].model
        assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
        _, per_fn = rc(["7"], ["7"], prompts=["3+4="])
    assert isinstance(per_fn["tiny_rm"][0], float) and rc.last_errors == {"tiny_rm": 0}

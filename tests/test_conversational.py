"""TRL's conversational format: a prompt column holding [{"role": ..., "content": ...}, ...] is rendered with the
tokenizer's chat template, with no template string."""

import json

import pytest

from grpo_dist.config import DataConfig, main
from grpo_dist.data import DataError, load_examples, render_prompt

pytestmark = pytest.mark.fast

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROWS = [{"prompt": [{"role": "system", "content": "You are a calculator."},
                    {"role": "user", "content": "What is 1+1?"}], "answer": "2"},
        {"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}]


def _tokenizer(chat_template=TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    t.chat_template = chat_template
    return t


def _data(tmp_path, rows=ROWS, **kw):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(preset=None, path=str(f), prompt_field="prompt", answer_field="answer", **kw)


def test_message_rows_are_rendered_with_the_chat_template(tmp_path):
    cfg = _data(tmp_path)  # use_chat_template stays false: the rows' format says it
    first, second = load_examples(cfg)
    assert (first.prompt, first.answer, second.prompt) == ("What is 1+1?", "2", "What is 2+3?")
    assert first.messages == ROWS[0]["prompt"]
    tok = _tokenizer()
    assert render_prompt(first, cfg, tok).text == \
        "<|system|>You are a calculator.<|end|><|user|>What is 1+1?<|end|><|assistant|>"
    assert render_prompt(second, cfg, tok).text == "<|user|>What is 2+3?<|end|><|assistant|>"
    with_system = _data(tmp_path, rows=ROWS[1:], system_prompt="Be brief.")  # added where a row has none
    assert render_prompt(load_examples(with_system)[0], with_system, tok).text == \
        "<|system|>Be brief.<|end|><|user|>What is 2+3?<|end|><|assistant|>"
    assert main(["--check", "none", "data.preset=null", f"data.path={cfg.path}", "data.prompt_field=prompt"]) == 0


@pytest.mark.parametrize("prompt,needle", [
    ([], "field 'prompt' is an empty list"),
    ([{"role": "user"}], "field 'prompt' is a list, but item 1 is not a message with 'role' and 'content'"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "'role' and 'content' must be strings"),
    ([{"role": "system", "content": "x"}], "has no message with role 'user' (roles: system)"),
])
def test_malformed_messages_name_file_and_line(tmp_path, prompt, needle):
    cfg = _data(tmp_path, rows=[ROWS[0], {"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError) as e:
        load_examples(cfg)
    assert str(e.value).startswith(f"{cfg.path}:2: ") and needle in str(e.value)


def test_text_only_settings_and_a_missing_chat_template_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"'data.prompt_template' = 'Q: \{prompt\}' applies to text prompts, but "
                                        r"row 1 "):
        load_examples(_data(tmp_path, prompt_template="Q: {prompt}"))
    with pytest.raises(DataError, match="'data.system_prompt' is set, but row 1 of the data has its own system"):
        load_examples(_data(tmp_path, system_prompt="Be brief."))
    cfg = _data(tmp_path)
    with pytest.raises(DataError, match="need a tokenizer with a chat_template"):
        render_prompt(load_examples(cfg)[0], cfg, _tokenizer(chat_template=None))

"""Tests of grpo_dist.data: loading, presets, errors, arithmetic set, prompt rendering, the sharded sampler."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from grpo_dist.config import DataConfig
from grpo_dist.data import (DataError, PromptExample, PromptSampler, extract_reference, load_examples,
                            render_prompt, resolve_data_config, synthetic_arithmetic)

pytestmark = pytest.mark.fast  # the `make fast` tier

# The offline mirror of the preset data (.ci/run points it at ../shared/data); the tests that read it skip without it.
SHARED = Path(os.environ.get("GRPO_DIST_DATA_DIR") or "/nonexistent-grpo-dist-data")
needs_shared = pytest.mark.skipif(not (SHARED / "gsm8k" / "test.jsonl").is_file(),
                                  reason="GRPO_DIST_DATA_DIR (the offline data mirror) is not set")


def cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


# ------------------------------------------------------------------------------------------------ presets / real files

@needs_shared
def test_gsm8k_preset_train_and_eval():
    c = cfg(preset="gsm8k")
    train = load_examples(c, "train")
    test = load_examples(c, "eval")
    assert len(train) == 7473 and len(test) == 1319
    assert train[0].answer == "72" and train[0].prompt.startswith("Natalia sold clips")
    assert test[0].answer == "18" and test[0].prompt.startswith("Janet")
    assert [e.index for e in test[:3]] == [0, 1, 2]
    assert all("," not in e.answer and e.answer for e in train)   # thousands separators stripped
    assert resolve_data_config(c).answer_format == "gsm8k"


@needs_shared
def test_math500_and_math_presets():
    m500 = load_examples(cfg(preset="math500"))
    assert len(m500) == 500
    assert m500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert load_examples(cfg(preset="math500"), "eval") == []
    math_train = load_examples(cfg(preset="math", limit=300))
    assert len(math_train) == 300 and math_train[0].answer == "2"   # last \boxed{} of row 0's solution
    math_eval = load_examples(cfg(preset="math"), "eval")
    assert [e.prompt for e in math_eval] == [e.prompt for e in m500]
    assert not {e.prompt for e in math_train} & {e.prompt for e in m500}


@needs_shared
def test_limit_and_explicit_overrides():
    assert len(load_examples(cfg(preset="gsm8k", limit=5))) == 5
    with pytest.raises(DataError, match="boxed"):   # an explicit (non-default) answer_format beats the preset's
        load_examples(cfg(preset="gsm8k", limit=5, answer_format="boxed"))
    # explicit path overrides the preset's file, the preset's fields stay
    rows = load_examples(cfg(preset="gsm8k", path=str(SHARED / "gsm8k" / "test.jsonl"), limit=2))
    assert rows[0].answer == "18"


def test_missing_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_DIST_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match="GRPO_DIST_DATA_DIR"):
        load_examples(cfg(preset="gsm8k"))


def test_env_data_dir(monkeypatch, tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "so\n#### 1,002"}) + "\n")
    monkeypatch.setenv("GRPO_DIST_DATA_DIR", str(tmp_path))
    assert load_examples(cfg(preset="gsm8k")) == [PromptExample("1+1?", "1002", 0)]
    with pytest.raises(DataError, match="test.jsonl"):
        load_examples(cfg(preset="gsm8k"), "eval")


# ------------------------------------------------------------------------------------------------ Hub presets

def _fake_hub(monkeypatch, tables: dict):
    """datasets.load_dataset answering from in-memory tables {(name, config, split): rows}, like the Hub would;
    records what was asked. An unknown key raises like an offline machine does. Skipped where `datasets` is not
    installed (the lent GPU machine's stack, .ci/gpu_stack_env.sh): there is nothing to fake."""
    datasets = pytest.importorskip("datasets")
    asked = []

    def load_dataset(name, config=None, split=None, **kw):
        asked.append((name, config, split))
        if (name, config, split) not in tables:
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")
        return datasets.Dataset.from_list(tables[(name, config, split)])
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("GRPO_DIST_DATA_DIR", raising=False)
    return asked


MATH500 = [{"problem": "Find $x$ if $2x = 4$.", "answer": "2", "solution": "so \\boxed{2}"},
           {"problem": "What is $1+1$?", "answer": "2", "solution": "\\boxed{2}"}]
MATH_TEST = [{"problem": "Find $x$ if  $2x = 4$.\n", "solution": "x = \\boxed{2}"},   # MATH-500's, spaced differently
             {"problem": "Compute $3^2$.", "solution": "It is \\boxed{9}."},
             {"problem": "What is $1+1$?", "solution": "\\boxed{2}"},
             {"problem": "Simplify $\\frac{4}{8}$.", "solution": "\\boxed{\\frac{1}{2}}"}]


def test_presets_load_from_the_hub_without_a_mirror(monkeypatch):
    asked = _fake_hub(monkeypatch, {
        ("openai/gsm8k", "main", "train"): [{"question": "Q1", "answer": "x\n#### 1,234"},
                                            {"question": "Q2", "answer": "#### 5"}],
        ("openai/gsm8k", "main", "test"): [{"question": "T1", "answer": "#### 7"}],
        ("HuggingFaceH4/MATH-500", None, "test"): MATH500,
        ("DigitalLearningGmbH/MATH-lighteval", "default", "test"): MATH_TEST})
    assert load_examples(cfg(preset="gsm8k")) == [PromptExample("Q1", "1234", 0), PromptExample("Q2", "5", 1)]
    assert load_examples(cfg(preset="gsm8k"), "eval") == [PromptExample("T1", "7", 0)]
    assert asked == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert [(e.prompt, e.answer) for e in load_examples(cfg(preset="math500"))] == [
        ("Find $x$ if $2x = 4$.", "2"), ("What is $1+1$?", "2")]
    # math: the MATH test set minus the MATH-500 problems (matched whatever the spacing), re-indexed from 0
    train = load_examples(cfg(preset="math"))
    assert [(e.prompt, e.answer, e.index) for e in train] == [("Compute $3^2$.", "9", 0),
                                                              ("Simplify $\\frac{4}{8}$.", "\\frac{1}{2}", 1)]
    assert len(load_examples(cfg(preset="math", limit=1))) == 1
    assert [e.prompt for e in load_examples(cfg(preset="math"), "eval")] == [r["problem"] for r in MATH500]


def test_math_preset_refuses_a_test_set_without_every_math500_problem(monkeypatch):
    _fake_hub(monkeypatch, {("HuggingFaceH4/MATH-500", None, "test"): MATH500,
                            ("DigitalLearningGmbH/MATH-lighteval", "default", "test"): MATH_TEST[1:]})
    with pytest.raises(DataError, match="holds 1 of the 2 problems"):
        load_examples(cfg(preset="math"))


def test_offline_without_a_mirror_is_one_clear_error(monkeypatch):
    _fake_hub(monkeypatch, {})
    with pytest.raises(DataError) as ei:
        load_examples(cfg(preset="gsm8k"))
    msg = str(ei.value)
    assert "openai/gsm8k" in msg and "GRPO_DIST_DATA_DIR" in msg and "ConnectionError" in msg


@pytest.mark.heavy  # a training subprocess: ~2.6 s; out of `make fast`
def test_offline_cli_exits_2_naming_dataset_and_variable(tmp_path):
    """The real `datasets` library on a machine with the Hub switched off: one line, exit code 2."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "GRPO_DIST_DATA_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "data.preset=math500", f"output_dir={tmp_path}/o",
                        "model.tiny={architecture: qwen2}"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    line = [x for x in r.stderr.splitlines() if "DataError" in x]
    assert len(line) == 1 and "HuggingFaceH4/MATH-500" in line[0] and "GRPO_DIST_DATA_DIR" in line[0], r.stderr


# ------------------------------------------------------------------------------------------------ file formats

ROWS = [{"q": "What is 2+2?", "sol": "it is \\boxed{4}"},
        {"q": "Half of 10?", "sol": "\\boxed{\\frac{10}{2}} = \\boxed{5}"},
        {"q": "Pi?", "sol": "\\boxed{\\{3, \\pi\\}}", "extra": 1}]
EXPECTED = [("What is 2+2?", "4"), ("Half of 10?", "5"), ("Pi?", "\\{3, \\pi\\}")]


def _custom(path, **kw):
    return cfg(preset=None, path=str(path), prompt_field="q", answer_field="sol", answer_format="boxed", **kw)


def _reads_rows(p):
    got = load_examples(_custom(p))
    assert [(e.prompt, e.answer) for e in got] == EXPECTED, p
    assert [e.index for e in got] == [0, 1, 2]
    assert len(load_examples(_custom(p, limit=2))) == 2


def test_jsonl_json(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in ROWS[:2]) + "\n\n  \n" + json.dumps(ROWS[2]) + "\n")
    js = tmp_path / "d.json"
    js.write_text(json.dumps(ROWS, indent=1))
    for p in (jl, js):
        _reads_rows(p)
    # eval split: eval_path with the same fields; none -> []
    assert len(load_examples(_custom(jl, eval_path=str(js)), "eval")) == 3
    assert load_examples(_custom(jl), "eval") == []


def test_parquet(tmp_path):
    pytest.importorskip("pyarrow")  # an optional reader: not on the lent GPU machine's stack (.ci/gpu_stack_env.sh)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pa_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": r["q"], "sol": r["sol"]} for r in ROWS]), pa_path)
    _reads_rows(pa_path)


def test_numbers_accepted(tmp_path):
    p = tmp_path / "n.jsonl"
    p.write_text(json.dumps({"question": 7, "answer": 18.0}) + "\n")
    assert load_examples(cfg(preset=None, path=str(p))) == [PromptExample("7", "18", 0)]


def _bad(tmp_path, lines, name="train.jsonl", **kw):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as ei:
        load_examples(cfg(preset=None, path=str(p), **kw))
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def test_malformed_rows(tmp_path):
    good = json.dumps({"question": "a", "answer": "1"})
    msg = _bad(tmp_path, [good, good, "{not json", good])
    assert "train.jsonl:3:" in msg and "not valid JSON" in msg
    msg = _bad(tmp_path, [good, json.dumps({"question": "a", "solution": "x"})])
    assert "train.jsonl:2: missing field 'answer' (fields present: question, solution)" in msg
    msg = _bad(tmp_path, [json.dumps({"question": ["a"], "answer": "1"})])
    assert "train.jsonl:1:" in msg and "'question'" in msg and "list" in msg
    msg = _bad(tmp_path, [json.dumps({"question": "a", "answer": None})])
    assert "train.jsonl:1:" in msg and "'answer'" in msg
    msg = _bad(tmp_path, [good, "[1, 2]"])
    assert "train.jsonl:2:" in msg and "not an object" in msg
    good_gsm = json.dumps({"question": "a", "answer": "so #### 1"})
    msg = _bad(tmp_path, [good_gsm, json.dumps({"question": "a", "answer": "no marker"})], answer_format="gsm8k")
    assert "train.jsonl:2:" in msg and "####" in msg
    msg = _bad(tmp_path, ['[{"question": "a", "answer": "1"},', ' {"question": "b"}]'], name="t.json")
    assert "t.json:2:" in msg and "missing field 'answer'" in msg
    msg = _bad(tmp_path, ["a,b"], name="t.csv")
    assert "unsupported" in msg


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_examples(cfg(preset=None, path=str(tmp_path / "nope.jsonl")))


def test_hf_without_datasets():
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets installed")
    except ImportError:
        pass
    with pytest.raises(DataError, match="datasets"):
        load_examples(cfg(preset=None, path="hf:openai/gsm8k:main:train"))


def test_extract_reference():
    assert extract_reference("x #### 5 #### 1,234 ", "gsm8k") == "1234"
    assert extract_reference("a \\boxed{1} b \\boxed{\\frac{1}{2}} c", "boxed") == "\\frac{1}{2}"
    assert extract_reference("so \\fbox{7}.", "boxed") == "7"
    assert extract_reference("so $\\boxed 7$.", "boxed") == "7"
    assert extract_reference("  -3 \n", "raw") == "-3"
    with pytest.raises(DataError):
        extract_reference("\\boxed{unbalanced", "boxed")



@pytest.mark.heavy  # fresh interpreters: ~3.5 s; out of `make fast`
def test_data_and_trainer_import_without_sympy():
    """References are read with the sympy-free extractor (grpo_dist.rewards.extract): importing the data loader or
    the trainer does not import the grader (grpo_dist.rewards.math) nor sympy."""
    import subprocess
    import sys
    # Some stacks import sympy themselves (torch 2.11, the lent GPU machine's: torch.distributed.tensor ->
    # torch.fx.experimental.symbolic_shapes, reached through transformers): what counts is the file
    # whose `import` statement first loads sympy, recorded by an import hook; it must not be one of grpo_dist's.
    code = """
import sys, traceback
class Who:
    def find_spec(self, name, path=None, target=None):
        if name == "sympy" and not hasattr(sys, "sympy_importer"):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            sys.sympy_importer = frames[-1].filename
        return None
sys.meta_path.insert(0, Who())
import grpo_dist.data, grpo_dist.trainer
print(repr(getattr(sys, "sympy_importer", None)), "sympy" in sys.modules, "grpo_dist.rewards.math" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    importer, sympy_loaded, math_loaded = r.stdout.strip().rsplit(" ", 2)
    assert math_loaded == "False", r.stdout
    if importer == "None":
        assert sympy_loaded == "False", r.stdout
    else:  # e.g. .../site-packages/torch/fx/...: not grpo_dist's doing
        assert sympy_loaded == "True" and "grpo_dist" not in Path(eval(importer)).parts, r.stdout

# ------------------------------------------------------------------------------------------------ arithmetic

def _evaluate(prompt: str) -> int:
    """Independent evaluator: tokenise digits/operators, apply '*' first, then '+'/'-' left to right."""
    assert prompt.endswith("=")
    tokens, num = [], ""
    for ch in prompt[:-1]:
        if ch.isdigit():
            num += ch
        else:
            tokens += [int(num), ch]
            num = ""
    tokens.append(int(num))
    i = 1
    while i < len(tokens):             # fold products
        if tokens[i] == "*":
            tokens[i - 1:i + 2] = [tokens[i - 1] * tokens[i + 1]]
        else:
            i += 2
    total = tokens[0]
    for op, x in zip(tokens[1::2], tokens[2::2]):
        total = total + x if op == "+" else total - x
    return total


def test_arithmetic_default_preset():
    c = cfg()   # preset arithmetic is the default
    train, ev = load_examples(c), load_examples(c, "eval")
    assert len(train) == 320 and len(ev) == 80            # 400 distinct problems split 80/20
    assert len({e.prompt for e in train}) == 320
    assert not {e.prompt for e in train} & {e.prompt for e in ev}
    for e in train + ev:
        assert e.answer == str(_evaluate(e.prompt))
        a, b = e.prompt[:-1].split("+")
        assert 0 <= int(a) <= 19 and 0 <= int(b) <= 19
    assert train == load_examples(c)
    assert load_examples(cfg(limit=10)) == train[:10]


def test_arithmetic_options_and_determinism():
    kw = dict(num_examples=50, max_operand=9, num_operands=3, ops="+-*", seed=3)
    a, b = synthetic_arithmetic(**kw), synthetic_arithmetic(**kw)
    assert a == b and len(a) == 50
    assert a != synthetic_arithmetic(**{**kw, "seed": 4})
    ev = synthetic_arithmetic(**kw, split="eval")
    assert not {e.prompt for e in a} & {e.prompt for e in ev}
    for e in a + ev:
        assert e.answer == str(_evaluate(e.prompt)) and e.prompt.count("=") == 1
    assert any("*" in e.prompt for e in a) and any(e.answer.startswith("-") for e in a + ev)
    # a large space (no enumeration) is still disjoint and deterministic
    big = dict(num_examples=2000, max_operand=999, num_operands=2, ops="+-")
    tr, ev = synthetic_arithmetic(**big), synthetic_arithmetic(**big, split="eval")
    assert len(tr) == 2000 and len(ev) == 500 and len({e.prompt for e in tr}) == 2000
    assert not {e.prompt for e in tr} & {e.prompt for e in ev}
    assert tr == synthetic_arithmetic(**big)
    assert all(e.answer == str(_evaluate(e.prompt)) for e in tr[:200])


def test_arithmetic_bad_options():
    with pytest.raises(DataError, match="data.arithmetic.size"):
        load_examples(cfg(arithmetic={"size": 3}))
    with pytest.raises(DataError, match="data.arithmetic.ops"):
        load_examples(cfg(arithmetic={"ops": "/"}))
    with pytest.raises(DataError, match="data.arithmetic.num_operands"):
        load_examples(cfg(arithmetic={"num_operands": 1}))


# ------------------------------------------------------------------------------------------------ rendering

def _tiny_tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<eos>": 1, "a": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        t.chat_template = chat_template
    return t


def test_render_prompt_template():
    ex = PromptExample("2+3=", "5", 0)
    assert render_prompt(ex, cfg(), None).text == "2+3="
    c = cfg(prompt_template="Q: {prompt}\nPut the answer in \\boxed{}.\nA:")
    assert render_prompt(ex, c, None).text == "Q: 2+3=\nPut the answer in \\boxed{}.\nA:"
    with pytest.raises(DataError, match="data.prompt_template"):
        render_prompt(ex, cfg(prompt_template="no placeholder"), None)


def test_render_prompt_chat_template():
    tmpl = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = _tiny_tokenizer(tmpl)
    ex = PromptExample("What is 1+1?", "2", 0)
    c = cfg(use_chat_template=True, prompt_template="Solve: {prompt}")
    assert render_prompt(ex, c, tok).text == "<|user|>Solve: What is 1+1?<|end|><|assistant|>"
    c = dataclasses.replace(c, system_prompt="Be brief.")
    assert render_prompt(ex, c, tok).text == "<|system|>Be brief.<|end|><|user|>Solve: What is 1+1?<|end|><|assistant|>"
    with pytest.raises(DataError, match="chat_template"):
        render_prompt(ex, c, _tiny_tokenizer())


# ------------------------------------------------------------------------------------------------ sampler

def _examples(n):
    return [PromptExample(f"p{i}", str(i), i) for i in range(n)]


def _steps(sampler, k):
    return [[e.index for e in sampler.next_batch()] for _ in range(k)]


@pytest.mark.parametrize("world", [2, 4])
def test_sampler_sharding(world):
    ex = _examples(37)
    ppr = 3
    samplers = [PromptSampler(ex, ppr, r, world, seed=7) for r in range(world)]
    spe = 37 // (ppr * world)
    assert all(s.steps_per_epoch == spe for s in samplers)
    per_rank = [_steps(s, 2 * spe) for s in samplers]
    for step in range(2 * spe):
        shards = [per_rank[r][step] for r in range(world)]
        flat = [i for s in shards for i in s]
        assert all(len(s) == ppr for s in shards)
        assert len(set(flat)) == ppr * world            # disjoint, exactly one global batch
    for epoch in range(2):                              # no prompt twice within an epoch
        seen = [i for r in range(world) for st in per_rank[r][epoch * spe:(epoch + 1) * spe] for i in st]
        assert len(seen) == len(set(seen)) == spe * ppr * world


def test_sampler_determinism_and_epochs():
    ex = _examples(20)
    a, b = PromptSampler(ex, 5, 0, 1, seed=1), PromptSampler(ex, 5, 0, 1, seed=1)
    sa, sb = _steps(a, 8), _steps(b, 8)
    assert sa == sb
    e0, e1 = sum(sa[:4], []), sum(sa[4:], [])
    assert sorted(e0) == sorted(e1) == list(range(20)) and e0 != e1
    assert a.epoch == 2 and a.step_in_epoch == 0
    assert _steps(PromptSampler(ex, 5, 0, 1, seed=2), 4) != sa[:4]


def test_sampler_rollover_drops_remainder():
    s = PromptSampler(_examples(10), 3, 0, 1, seed=0)
    assert s.steps_per_epoch == 3
    _steps(s, 2)
    assert (s.epoch, s.step_in_epoch) == (0, 2)
    _steps(s, 1)
    assert (s.epoch, s.step_in_epoch) == (1, 0)


def test_sampler_too_few_examples():
    with pytest.raises(DataError, match="7 examples is fewer than one global batch of prompts_per_rank x "
                                        "world_size = 4 x 2 = 8"):
        PromptSampler(_examples(7), 4, 0, 2, seed=0)


def test_sampler_resume_across_epoch_boundary():
    ex = _examples(23)
    ref = [PromptSampler(ex, 2, r, 2, seed=5) for r in range(2)]
    full = [_steps(s, 14) for s in ref]                 # 5 steps per epoch -> crosses two boundaries
    for cut in (3, 5, 9):
        run = [PromptSampler(ex, 2, r, 2, seed=5) for r in range(2)]
        head = [_steps(s, cut) for s in run]
        states = [json.loads(json.dumps(s.state_dict())) for s in run]   # survives JSON round trip
        fresh = [PromptSampler(ex, 2, r, 2, seed=5) for r in range(2)]
        for s, st in zip(fresh, states):
            s.load_state_dict(st)
        tail = [_steps(s, 14 - cut) for s in fresh]
        assert [h + t for h, t in zip(head, tail)] == full
    assert set(states[0]) == {"epoch", "step_in_epoch", "seed", "num_examples", "world_size", "prompts_per_rank"}


def test_sampler_world_size_change():
    ex = _examples(40)
    old = [PromptSampler(ex, 2, r, 4, seed=0) for r in range(4)]
    for s in old:
        _steps(s, 3)
    nxt_old = [i for s in old for i in _steps(s, 1)[0]]
    state = old[0].state_dict()
    state_before = dict(state, step_in_epoch=state["step_in_epoch"] - 1)
    # same global batch (4 x 2 == 2 x 4): the next global batch is identical, only split differently
    new = [PromptSampler(ex, 4, r, 2, seed=0) for r in range(2)]
    for s in new:
        s.load_state_dict(state_before)
    assert [i for s in new for i in _steps(s, 1)[0]] == nxt_old
    with pytest.raises(DataError, match="global batch"):
        PromptSampler(ex, 2, 0, 2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        PromptSampler(ex, 2, 0, 4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="examples"):
        PromptSampler(_examples(41), 2, 0, 4, seed=0).load_state_dict(state)


def test_data_mirror_tool_writes_what_the_presets_read(monkeypatch, tmp_path):
    """grpo_dist.tools.data_mirror (the README's recipe for an offline machine) writes every preset file from the
    rows `datasets` returns, and the presets then load those rows through GRPO_DIST_DATA_DIR. The loader is faked:
    what is checked is the mirror's layout and fields, not the Hub."""
    from grpo_dist.data.presets import HUB_SOURCES
    from grpo_dist.tools.data_mirror import write_mirror
    boxed = "so it is $\\boxed{4}$."
    rows = {"openai/gsm8k": [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}],
            "HuggingFaceH4/MATH-500": [{"problem": "What is $2+2$?", "solution": boxed, "answer": "4"}],
            "DigitalLearningGmbH/MATH-lighteval": [{"problem": "What is $2+2$?", "solution": boxed},
                                                   {"problem": "What is $3+3$?", "solution": "$\\boxed{6}$"}]}
    asked = []

    def load(name, config, split):
        asked.append((name, config, split))
        return iter(rows[name])

    done = write_mirror(tmp_path, load)
    assert sorted(asked) == sorted(HUB_SOURCES.values()) and set(done) == set(HUB_SOURCES)
    assert done["math_test5000/test.jsonl"][0] == 2 and not list(tmp_path.rglob("*.partial"))
    monkeypatch.setenv("GRPO_DIST_DATA_DIR", str(tmp_path))
    assert [(e.prompt, e.answer) for e in load_examples(cfg(preset="gsm8k"))] == [("What is 2+2?", "4")]
    assert [e.answer for e in load_examples(cfg(preset="math500"))] == ["4"]
    math_train = load_examples(cfg(preset="math"))  # MATH minus MATH-500: only the 3+3 problem is left
    assert [(e.prompt, e.answer) for e in math_train] == [("What is $3+3$?", "6")]

"""The decode step that CUDA graphs capture (LeanDecoder.static_step: no per-step Python numbers, every cache
column read with the later ones masked) equals the eager step bitwise on CPU, without capture, at every decode
batch size compaction gives; lean_cuda_graphs is refused where it cannot work."""

import pytest
import torch

from grpo_dist.config import ModelConfig
from grpo_dist.decoder import LeanDecoder
from grpo_dist.models import load_model, load_tokenizer

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("one_thread")]


def _model(arch, dtype):
    cfg = ModelConfig(tiny=dict(architecture=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=64), dtype=dtype)
    tok = load_tokenizer(cfg)
    return tok, load_model(cfg, tok).eval().requires_grad_(False)


@pytest.mark.parametrize("arch,dtype", [("qwen2", "float32"), ("qwen3", "float32"), ("llama", "float32"),
                                        ("qwen2", "bfloat16")])
@torch.inference_mode()
def test_static_step_equals_the_eager_step_bitwise_in_every_bucket(arch, dtype):
    tok, model = _model(arch, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tok), (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: masked prompt columns
    repeats = torch.tensor([10, 8, 6])  # 24 rows: buckets 24, 16, 8
    eager, static = LeanDecoder(model), LeanDecoder(model, cuda_graphs=True, capture=False)
    new_tokens = 70  # 7 + 70 cache columns: attention widths 64, then 77 (LeanDecoder.attention_width)
    a, b = eager.prefill(ids, mask, repeats, new_tokens), static.prefill(ids, mask, repeats, new_tokens)
    assert torch.equal(a, b)
    rows = 24
    sizes, widths = [], set()
    for t in range(new_tokens - 1):
        if t in (3, 60):  # compaction to the next bucket: keep every other row, then the first 8
            keep = torch.arange(0, rows, 3)[:16] if t == 3 else torch.arange(8)
            keep = torch.cat([keep, torch.arange(rows)[~torch.isin(torch.arange(rows), keep)]])[:16 if t == 3 else 8]
            keep = keep.sort().values
            eager.compact(keep)
            static.compact(keep)
            rows = len(keep)
        tokens = torch.randint(5, len(tok), (rows,), generator=g)
        widths.add(eager.attention_width(eager.length + 1))
        a, b = eager.step(tokens), static.step(tokens)
        sizes.append(rows)
        assert a.shape == (rows, len(tok))
        assert torch.equal(a, b), (t, rows, (a.float() - b.float()).abs().max())
        assert eager.length == static.length and torch.equal(eager.next_position, static.next_position)
    assert sorted(set(sizes)) == [8, 16, 24] and widths == {64, 77}
    for (ka, va), (kb, vb) in zip(eager.cache, static.cache):  # the caches hold the same keys and values
        assert torch.equal(ka[:, :, :eager.length], kb[:, :, :static.length])
        assert torch.equal(va[:, :, :eager.length], vb[:, :, :static.length])


def test_lean_cuda_graphs_is_refused_without_cuda_and_with_another_engine():
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.preflight import check_cuda_graphs
    with pytest.raises(ConfigError, match="'lean_cuda_graphs' = true needs rollout_engine=lean"):
        load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=true", "rollout_engine=hf"])
    cfg = load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=true"])
    with pytest.raises(ConfigError, match="'lean_cuda_graphs' = true needs a CUDA device"):
        check_cuda_graphs(cfg, torch.device("cpu"))
    check_cuda_graphs(cfg, torch.device("cuda", 0))  # the device it is meant for passes
    assert load_config(None, ["data.preset=arithmetic"]).lean_cuda_graphs is False


def test_lean_cuda_graphs_auto_is_on_only_for_the_lean_engine_on_cuda():
    """auto: on where the device is CUDA and the engine lean, off elsewhere (never refused); other strings are."""
    from grpo_dist.config import ConfigError, lean_cuda_graphs_on, load_config
    from grpo_dist.preflight import check_cuda_graphs
    auto = load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=auto"])
    assert auto.lean_cuda_graphs == "auto"
    check_cuda_graphs(auto, torch.device("cpu"))  # not refused: auto is off here
    assert not lean_cuda_graphs_on(auto, torch.device("cpu"))
    assert lean_cuda_graphs_on(auto, torch.device("cuda", 0))
    hf = load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=auto", "rollout_engine=hf"])
    assert not lean_cuda_graphs_on(hf, torch.device("cuda", 0))
    on = load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=true"])
    assert lean_cuda_graphs_on(on, "cpu") and not lean_cuda_graphs_on(load_config(None, ["data.preset=arithmetic"]),
                                                                       torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="'lean_cuda_graphs' must be true, false or auto"):
        load_config(None, ["data.preset=arithmetic", "lean_cuda_graphs=sometimes"])


def test_lean_compile_defaults_off_and_is_refused_without_cuda_and_with_another_engine():
    """lean_compile (torch.compile of the decode step) is not measured anywhere but CUDA: refused elsewhere with
    one line, before any model loads; off by default."""
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.preflight import check_cuda_graphs
    assert load_config(None, ["data.preset=arithmetic"]).lean_compile is False
    with pytest.raises(ConfigError, match="'lean_compile' = true needs rollout_engine=lean"):
        load_config(None, ["data.preset=arithmetic", "lean_compile=true", "rollout_engine=hf"])
    cfg = load_config(None, ["data.preset=arithmetic", "lean_compile=true"])
    with pytest.raises(ConfigError, match="'lean_compile' = true needs a CUDA device"):
        check_cuda_graphs(cfg, torch.device("cpu"))
    check_cuda_graphs(cfg, torch.device("cuda", 0))


# ---------------------------------------------------------------------------- CUDA graphs captured once per run
def test_graph_buckets_are_powers_of_two_up_to_the_largest_batch():
    from grpo_dist.decoder import bucket_of, graph_buckets
    assert graph_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert graph_buckets(24) == (1, 2, 4, 8, 16, 24) and graph_buckets(1) == (1,)
    b = graph_buckets(24)
    assert [bucket_of(n, b) for n in (1, 3, 5, 9, 16, 17, 24)] == [1, 4, 8, 16, 16, 24, 24]
    assert bucket_of(25, b) is None  # more rows than the largest bucket: the eager path


def _greedy_run(decoder, ids, mask, repeats, new_tokens, compact_at=None, keep=None):
    """Prefill, then greedy steps feeding each step's argmax; compaction to `keep` after step compact_at. Returns
    the logits of every position (the prefill's last, then each step's), fp32."""
    out = [decoder.prefill(ids, mask, repeats, new_tokens)]
    for t in range(new_tokens - 1):
        tokens = out[-1].argmax(-1)
        if t == compact_at:
            decoder.compact(keep)
            tokens = tokens[keep]
        out.append(decoder.step(tokens))
    return out


@torch.inference_mode()
def test_run_buffers_serve_consecutive_rollouts_of_other_sizes_as_the_eager_decoder_does():
    """One decoder with the run's buffers (capacity 12 rows x 80 tokens: buckets 1, 2, 4, 8, 12) decodes a rollout
    of 12 rows with a compaction to 5 (bucket 8: 3 padding rows), then one of 6 rows (bucket 8, its padding rows
    holding the first rollout's keys) with a longer prompt: every position's logits equal a fresh eager decoder's
    within 1e-5 (fp32; the static step attends over more masked columns) and the greedy tokens are the same. The
    caches are the same tensors in both rollouts (allocated once); before, every prefill allocated new ones."""
    tok, model = _model("qwen2", "float32")
    g = torch.Generator().manual_seed(1)
    static = LeanDecoder(model, cuda_graphs=True, capture=False, capacity=(12, 80))
    rollouts = [(torch.randint(5, len(tok), (3, 9), generator=g), torch.tensor([4, 4, 4]), 3,
                 torch.tensor([0, 2, 5, 7, 11])),
                (torch.randint(5, len(tok), (2, 21), generator=g), torch.tensor([3, 3]), None, None)]
    addresses = []
    for ids, repeats, compact_at, keep in rollouts:
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        want = _greedy_run(LeanDecoder(model), ids, mask, repeats, 40, compact_at, keep)
        got = _greedy_run(static, ids, mask, repeats, 40, compact_at, keep)
        assert static.graphs.run_active
        addresses.append([k.data_ptr() for k, _ in static.cache])
        for t, (a, b) in enumerate(zip(want, got)):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
            assert torch.equal(a.argmax(-1), b.argmax(-1)), t
            lp_a, lp_b = a.float().log_softmax(-1), b.float().log_softmax(-1)
            assert (lp_a - lp_b).abs().max() < 1e-5
    assert addresses[0] == addresses[1]
    assert static.graphs.memory()["buckets"] == (1, 2, 4, 8, 12) and static.graphs.fallbacks == {}


@torch.inference_mode()
def test_rollouts_the_run_buffers_cannot_hold_decode_eagerly_with_one_line_each():
    """More rows than the largest bucket, or a prompt + completion longer than the captured cache: that rollout
    decodes on its own caches (bitwise the eager decoder), one line naming why, said once per reason and counted;
    a rollout that fits goes back to the run's buffers."""
    tok, model = _model("qwen2", "float32")
    lines = []
    static = LeanDecoder(model, cuda_graphs=True, capture=False, capacity=(8, 30), say=lines.append)
    g = torch.Generator().manual_seed(2)
    cases = [(torch.randint(5, len(tok), (3, 6), generator=g), torch.tensor([4, 4, 4]), 10),  # 12 rows > 8
             (torch.randint(5, len(tok), (2, 6), generator=g), torch.tensor([4, 4]), 10),  # 8 rows, 16 tokens: fits
             (torch.randint(5, len(tok), (2, 12), generator=g), None, 20),  # 32 tokens > 30
             (torch.randint(5, len(tok), (3, 6), generator=g), torch.tensor([4, 4, 4]), 10)]  # rows again
    active = []
    for ids, repeats, new in cases:
        mask = torch.ones_like(ids)
        want = _greedy_run(LeanDecoder(model), ids, mask, repeats, new)
        got = _greedy_run(static, ids, mask, repeats, new)
        active.append(static.graphs.run_active)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert active == [False, True, False, False]
    assert lines == ["[grpo_dist] lean decoder: this rollout decodes eagerly, without CUDA graphs: 12 decode rows "
                     "exceed the largest CUDA-graph bucket (8) (said once; later ones are counted)",
                     "[grpo_dist] lean decoder: this rollout decodes eagerly, without CUDA graphs: prompt + "
                     "completion of 32 tokens exceed the captured cache (30) (said once; later ones are counted)"]
    assert static.graphs.fallbacks == {"rows": 2, "length": 1}


def test_an_unsupported_model_decodes_with_the_transformers_forward_and_one_line():
    from grpo_dist.rollout import HFDecoder, RunDecoder, make_decoder
    tok, model = _model("qwen2", "float32")
    lines = []
    run = RunDecoder((8, 100), cuda_graphs=True, compile_step=False, capture=False, say=lines.append)
    first = make_decoder(model, 100, cuda_graphs=True, run=run)
    assert isinstance(first, LeanDecoder) and make_decoder(model, 100, cuda_graphs=True, run=run) is first
    model.model.layers[0].self_attn.sliding_window = 16
    assert isinstance(make_decoder(model, 100, cuda_graphs=True, run=run), HFDecoder)
    assert isinstance(make_decoder(model, 100, cuda_graphs=True, run=run), HFDecoder)
    assert lines == ["[grpo_dist] lean decoder: decoding with the transformers forward, without CUDA graphs: "
                     "sliding window 16 is shorter than the sequence (100 tokens)"]
    model.model.layers[0].self_attn.sliding_window = None
    # parameters replaced (not filled in place): a new decoder, whose graphs read the new weights
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    again = make_decoder(model, 100, cuda_graphs=True, run=run)
    assert again is not first and "captured again" in lines[-1]


@torch.inference_mode()
def test_the_lean_engine_keeps_one_decoder_for_the_run_and_says_its_memory_once(capsys):
    """ReplicaRolloutEngine with lean_cuda_graphs on a CPU (the static step, uncaptured): two generate calls of
    different sizes give the eager engine's tokens and log-probs (greedy, fp32, within 1e-5) from one decoder; the
    sizing line at start and the memory line after the first rollout are said once."""
    from grpo_dist.rollout_engines import ReplicaRolloutEngine, SamplingSpec
    tok, model = _model("qwen2", "float32")
    eager = ReplicaRolloutEngine(model, True, tok.pad_token_id)
    graphs = ReplicaRolloutEngine(model, True, tok.pad_token_id, cuda_graphs=True, capacity=(16, 40))
    assert "KV cache 0.000 GiB for 16 rows x 40 tokens" in capsys.readouterr().out
    g = torch.Generator().manual_seed(3)
    spec = SamplingSpec(n=4, max_tokens=12, eos_ids=(tok.eos_token_id,), greedy=True)
    decoders = []
    for prompts in (3, 2):
        ids = [torch.randint(5, len(tok), (int(n),), generator=g).tolist()
               for n in torch.randint(3, 15, (prompts,), generator=g)]
        a, b = eager.generate(ids, spec), graphs.generate(ids, spec)
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for ra, rb in zip(a.logprobs, b.logprobs) for x, y in zip(ra, rb)) < 1e-5
        decoders.append(graphs.run.current)
    assert decoders[0] is decoders[1]
    out = capsys.readouterr().out
    assert out.count("[grpo_dist] lean decoder static step: KV cache") == 1 and "buckets [1, 2, 4, 8, 16]" in out

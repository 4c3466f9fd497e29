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

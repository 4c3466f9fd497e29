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

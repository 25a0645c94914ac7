"""Shared setup of the pytest-benchmark files: one torch thread, so figures compare
across runs on a shared 2-core machine (two threads fight whatever else holds a core)."""
import pytest
import torch


@pytest.fixture
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

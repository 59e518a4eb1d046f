"""Shared fixtures."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """fp16 GEMMs on this CPU run an OpenMP region that stalls for milliseconds when a core is busy;
    tiny fp16 tests run far faster (and more predictably) on one intra-op thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

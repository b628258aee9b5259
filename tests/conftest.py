"""Fixtures several test files share. Helper modules live in tests/helpers/ (`from helpers.launches import TINY`)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only waits on the first (a 100x slower first forward on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

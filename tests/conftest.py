"""Fixtures shared by the proxy-model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module: the proxies' numbers are then reproducible."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus():
    from workloads.proxy.data import load_corpus
    return load_corpus()

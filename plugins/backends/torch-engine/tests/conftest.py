"""Fixtures of the engine tests (a module that defines its own ``engine`` keeps it)."""
import sys
from pathlib import Path

import pytest
import torch
from miles.testing import TinySpec, char_tokenizer

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

sys.path.insert(0, str(Path(__file__).parent))  # spec_checks


@pytest.fixture(scope="module")
def engine():
    """The torch engine on a tiny random Qwen2, on one CPU thread (the tests share 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread: tiny GEMMs gain nothing from more, and OpenMP spin-waits make them
    far slower when another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Fixtures the kernel tests share."""
import zlib

import pytest
import torch


@pytest.fixture
def gen(request):
    """A generator seeded by the test's own id: fresh data for every test and parameter set,
    the same from run to run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

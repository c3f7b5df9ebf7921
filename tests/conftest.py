"""Fixtures shared across the test packages."""
from __future__ import annotations

import importlib
import zlib

import pytest

INTEGRATION_OPTION = "--integration"
SLOW_OPTION = "--slow"
API_OPTION = "--api"
TP_OPTION = "--tp"
# Markers whose tests skip unless their option is given, so that `make test` stays within its time:
# marker -> (option, the make target that runs them)
OPT_IN_MARKERS = {"integration": (INTEGRATION_OPTION, "make test-integration"), "slow": (SLOW_OPTION, "make test-slow"),
                  "api": (API_OPTION, "make test-api"), "tp": (TP_OPTION, "make test-tp")}


def pytest_addoption(parser):
    parser.addoption(INTEGRATION_OPTION, action="store_true",
                     help="also run the tests marked integration: system tools (Prometheus, buildah and podman) "
                          "and minutes each; `make test-integration` runs them")
    parser.addoption(SLOW_OPTION, action="store_true",
                     help="also run the tests marked slow: more combinations of the embedded model's streamed and "
                          "sliced runs and the Triton interpreter's slowest shapes, half a minute each; "
                          "`make test-slow` runs them")
    parser.addoption(API_OPTION, action="store_true",
                     help="also run the tests marked api: schemathesis fuzzing a live server from its /openapi.json, "
                          "a few minutes; `make test-api` runs them")
    parser.addoption(TP_OPTION, action="store_true",
                     help="also run the tests marked tp: tensor parallelism over Ray actors, two ranks on this "
                          "host, a few minutes; `make test-tp` runs them")


def pytest_collection_modifyitems(config, items):
    """Tests of an opt-in marker skip unless their option is given; tests marked cuda skip without a
    CUDA device (`make test-gpu` runs exactly those where one is)."""
    skip_cuda = pytest.mark.skip(reason="no CUDA device: `make test-gpu` runs it where a GPU is lent")
    if not _cuda_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)
    for marker, (option, target) in OPT_IN_MARKERS.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"{marker} test: `{target}` runs it ({option})")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def import_interpreted(name: str):
    """The Triton kernel module `name` with its kernels built for Triton's interpreter, so that they
    run on CPU tensors. triton.jit reads TRITON_INTERPRET when it decorates a kernel, so the module
    is imported (or re-imported) with the variable set; triton's knob scope then puts the variable
    back as it was, and no other test sees it."""
    triton = pytest.importorskip("triton")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        module = importlib.import_module(name)
        if not module.INTERPRETED:  # imported earlier for a GPU
            module = importlib.reload(module)
    assert module.INTERPRETED
    return module


@pytest.fixture(scope="session")
def interpreted_w4a16():
    return import_interpreted("kernels.triton.w4a16")


@pytest.fixture(scope="session")
def interpreted_paged_decode():
    return import_interpreted("kernels.triton.paged_decode")


@pytest.fixture(scope="session")
def interpreted_paged_prefill():
    return import_interpreted("kernels.triton.paged_prefill")


@pytest.fixture(scope="session")
def interpreted_kv_quant_write():
    return import_interpreted("kernels.triton.kv_quant_write")


@pytest.fixture
def gen(request):
    """A generator seeded by the test's own id: fresh data for every test and parameter set,
    the same from run to run."""
    import torch

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

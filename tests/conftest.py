"""Fixtures shared across the test packages."""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import zlib

import kernels  # noqa: F401  before any test imports torch: it caps torch's OpenMP spinning
import pytest

from session_cache import CACHE_DIR_ENV  # tests/ is on sys.path (pyproject.toml's pythonpath)

INTEGRATION_OPTION = "--integration"
SLOW_OPTION = "--slow"
API_OPTION = "--api"
TP_OPTION = "--tp"
ISA_OPTION = "--isa"
MULTINODE_OPTION = "--multinode"
# Markers whose tests skip unless their option is given, so that `make test` stays within its time:
# marker -> (option, the make target that runs them)
OPT_IN_MARKERS = {"integration": (INTEGRATION_OPTION, "make test-integration"), "slow": (SLOW_OPTION, "make test-slow"),
                  "api": (API_OPTION, "make test-api"), "tp": (TP_OPTION, "make test-tp"),
                  "isa": (ISA_OPTION, "make test-isa"), "multinode": (MULTINODE_OPTION, "make test-multinode")}
# Modules whose every test is marked api: without --api they are not even collected (schemathesis
# builds its cases from the schema while collecting, and the SDKs take seconds to import).
API_ONLY_MODULES = frozenset({"test_schemathesis.py", "test_agent_protocols.py", "test_structured_and_tools.py"})

_CACHE_DIR_KEY = pytest.StashKey[str]()
_USER_CACHE_DIR_KEY = pytest.StashKey["str | None"]()  # put back when the session ends


def pytest_configure(config):
    """One profile cache for the whole session, in a temporary directory: tests never read or write
    the user's ~/.cache/tandem (whose profiles would hide a measurement that fails), and what one
    test measured (cost tables, thread profiles, slicing costs, expert statistics) later tests and
    the servers they start (os.environ, which subprocesses inherit) reuse. Tests of a cache miss
    pass their own directory."""
    config.stash[_CACHE_DIR_KEY] = tempfile.mkdtemp(prefix="tandem-test-cache-")
    config.stash[_USER_CACHE_DIR_KEY] = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = config.stash[_CACHE_DIR_KEY]


def pytest_unconfigure(config):
    if _CACHE_DIR_KEY not in config.stash:
        return
    user_cache_dir = config.stash[_USER_CACHE_DIR_KEY]
    if user_cache_dir is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = user_cache_dir
    shutil.rmtree(config.stash[_CACHE_DIR_KEY], ignore_errors=True)


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
    parser.addoption(ISA_OPTION, action="store_true",
                     help="also run the tests marked isa: the CPU kernels compiled for other instruction sets "
                          "(aarch64 NEON, with and without dotprod) and run under qemu-user, a minute or two; "
                          "`make test-isa` installs the tools and runs them")
    parser.addoption(MULTINODE_OPTION, action="store_true",
                     help="also run the tests marked multinode: tensor parallelism over two Ray nodes, each in "
                          "its own network namespace joined by a shaped veth link; needs root and iproute2, a few "
                          "minutes; `make test-multinode` runs them")


def pytest_ignore_collect(collection_path, config):
    if collection_path.name in API_ONLY_MODULES and not config.getoption(API_OPTION):
        return True
    return None


def _check_api_only_modules(items) -> None:
    """A test without the api marker in an api-only module would run nowhere: make test does not
    collect the module and make test-api deselects the test."""
    strays = [item.nodeid for item in items
              if item.path.name in API_ONLY_MODULES and item.get_closest_marker("api") is None]
    if strays:
        raise pytest.UsageError(f"not marked api but in an api-only module (tests/conftest.py): {strays}")


# Modules of half a minute or more on two cores: queued first, so that `make test`'s two processes
# (pytest-xdist, whole files each) do not end with one of them running a long module alone.
LONG_MODULES = ("test_mlp_slicing_generation.py", "test_streaming_server.py", "test_readme_examples.py",
                "test_weight_streaming.py", "test_generation.py", "test_cli.py", "test_prefix_caching.py",
                "test_stage.py", "test_offload_generation.py")


def pytest_collection_modifyitems(config, items):
    """Long modules first (a stable sort: each module's tests stay together, in order). Tests of an
    opt-in marker skip unless their option is given; tests marked cuda skip without a CUDA device
    (`make test-gpu` runs exactly those where one is)."""
    items.sort(key=lambda item: item.path.name not in LONG_MODULES)
    skip_cuda = pytest.mark.skip(reason="no CUDA device: `make test-gpu` runs it where a GPU is lent")
    if not _cuda_available():  # the marker, not a keyword: "cuda" in a parameter id is no reason to skip
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip_cuda)
    _check_api_only_modules(items)
    for marker, (option, target) in OPT_IN_MARKERS.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"{marker} test: `{target}` runs it ({option})")
        for item in items:
            if item.get_closest_marker(marker) is not None:
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


def import_compiled(name: str):
    """The Triton kernel module `name` as the engine imports it on a GPU: its kernels compiled for
    CUDA (and autotuned, where the module autotunes), re-imported with the interpreter off if a
    test imported it interpreted."""
    triton = pytest.importorskip("triton")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        module = importlib.import_module(name)
        if module.INTERPRETED:
            module = importlib.reload(module)
    assert not module.INTERPRETED
    return module


# The fixtures below are per test, not per session: a reload changes the one module object that
# sys.modules and the engine hold, so each test checks that it has the build it asked for.
@pytest.fixture
def interpreted_w4a16():
    return import_interpreted("kernels.triton.w4a16")


@pytest.fixture
def compiled_w4a16():
    """Compiled as on a GPU: its kernels can still be compiled ahead of time for a named card here."""
    return import_compiled("kernels.triton.w4a16")


@pytest.fixture
def interpreted_paged_decode():
    return import_interpreted("kernels.triton.paged_decode")


@pytest.fixture
def interpreted_paged_prefill():
    return import_interpreted("kernels.triton.paged_prefill")


@pytest.fixture
def interpreted_kv_quant_write():
    return import_interpreted("kernels.triton.kv_quant_write")


# A Triton kernel test runs twice: on CPU tensors under the interpreter (every `make test`), and
# compiled on a CUDA device, where the half-precision math is real (`make test-gpu`; skipped here).
TRITON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request) -> str:
    """The device of a Triton kernel test; the kernel fixtures below share it, so that a test
    taking two of them runs once per device."""
    return request.param


def triton_kernels(name: str, device: str):
    """(module, device): kernels.triton.`name` interpreted for cpu, compiled for cuda."""
    name = f"kernels.triton.{name}"
    return (import_interpreted(name) if device == "cpu" else import_compiled(name)), device


@pytest.fixture
def triton_w4a16(triton_device):
    return triton_kernels("w4a16", triton_device)


@pytest.fixture
def triton_paged_decode(triton_device):
    return triton_kernels("paged_decode", triton_device)


@pytest.fixture
def triton_paged_prefill(triton_device):
    return triton_kernels("paged_prefill", triton_device)


@pytest.fixture
def triton_kv_quant_write(triton_device):
    return triton_kernels("kv_quant_write", triton_device)


@pytest.fixture(scope="session")
def llm():
    """The embedded model as `tandem serve` loads it by default, in float32, for the session: the
    engine tests read its generations, the server tests compare the server's with them. Tests that
    count from zero, plant failures or abort requests build their own engine."""
    from engine import LLM

    with LLM("smollm2-135m", dtype="float32") as shared:
        yield shared


@pytest.fixture
def gen(request):
    """A generator seeded by the test's own id: fresh data for every test and parameter set,
    the same from run to run."""
    import torch

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

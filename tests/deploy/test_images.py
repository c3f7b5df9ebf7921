"""The Dockerfiles build here and their images serve: buildah builds each on a Debian base made by
debootstrap (images.py says what this sandbox needed and why), then podman runs it, /health
answers from the host, the image's own HEALTHCHECK passes, a completion comes back, the server
runs as a non-root user without a C++ compiler, and it stops cleanly on SIGTERM. The CUDA image
is built with torch's CPU build in place of its CUDA one (the only wheel this machine has) and
runs with TANDEM_DEVICE=cpu: it checks that Dockerfile's steps, not CUDA."""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

import images
from dockerfiles import DOCKERFILES, ROOT, makefile_torch_pin
from tandem_server import free_port

pytestmark = pytest.mark.integration
STARTUP_TIMEOUT_S = 180.0
IMAGE_USER_ID = "10001"
# CPU Dockerfile: torch from the local wheelhouse's index instead of torch's CPU index
BUILD_ARGS = {"cpu": {"TORCH_INDEX_URL": f"file://{images.WHEELHOUSE}/simple"}, "cuda": {}}
# what each image needs to run on this CPU-only machine, as an operator would set it
RUN_ENVIRONMENT = {"cpu": {}, "cuda": {"TANDEM_DEVICE": "cpu"}}


@pytest.fixture(scope="module")
def build_inputs():
    """The local base image and the torch wheelhouse, or a skip saying why they cannot be made."""
    missing = images.missing_tools()
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (`make test-integration` apt-installs them)")
    workdir = images.scratch_dir()
    try:
        images.make_local_base(workdir)
        return workdir, images.cpu_torch_wheelhouse(makefile_torch_pin(), workdir)
    except images.CannotBuildHere as reason:
        pytest.skip(f"cannot build images here: {reason}")


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def image(request, build_inputs) -> Iterator[tuple[str, str]]:
    kind = request.param
    workdir, wheelhouse = build_inputs
    tag = f"localhost/tandem-test:{kind}"
    images.remove_build_leftovers(tag)
    try:
        result = images.build(DOCKERFILES[kind], tag, ROOT, wheelhouse, workdir, BUILD_ARGS[kind])
        output = result.stdout[-4000:] + result.stderr[-4000:]
        assert result.returncode == 0, f"buildah bud {DOCKERFILES[kind].name} failed:\n{output}"
        yield kind, tag
    finally:
        images.remove_build_leftovers(tag)


@pytest.fixture
def container(image):
    kind, tag = image
    port = free_port()
    env = {"TANDEM_PORT": str(port), **RUN_ENVIRONMENT[kind]}
    env_flags = [item for name, value in env.items() for item in ("-e", f"{name}={value}")]
    name = f"tandem-test-{kind}-{port}"
    started = images.run("podman", "run", "-d", "--name", name, *images.RUN_FLAGS, *env_flags, tag,
                         "--dtype", "float32")
    assert started.returncode == 0, started.stderr
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        images.run("podman", "rm", "-f", name)


def wait_healthy(name: str, url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        state = images.run("podman", "inspect", name, "--format", "{{.State.Status}}").stdout.strip()
        assert state == "running", f"container {state}:\n{images.run('podman', 'logs', name).stderr[-4000:]}"
        time.sleep(1.0)
    raise AssertionError(f"no /health in {STARTUP_TIMEOUT_S} s:\n{images.run('podman', 'logs', name).stderr[-4000:]}")


def test_the_image_serves_and_passes_its_healthcheck(container):
    name, url = container
    wait_healthy(name, url)
    healthcheck = images.run("podman", "healthcheck", "run", name)
    assert healthcheck.returncode == 0, healthcheck.stdout + healthcheck.stderr
    response = httpx.post(f"{url}/v1/completions", timeout=60.0, json={
        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
    assert images.run("podman", "exec", name, "id", "-u").stdout.strip() == IMAGE_USER_ID
    assert images.run("podman", "exec", name, "sh", "-c", "command -v g++ c++").returncode != 0
    stopped = images.run("podman", "stop", "-t", "20", name)
    assert stopped.returncode == 0, stopped.stderr
    assert images.run("podman", "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"

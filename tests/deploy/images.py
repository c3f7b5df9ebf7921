"""Building and running the Dockerfiles here with Debian's buildah and podman, on a base image
made locally by debootstrap from Debian's packages.

What this sandbox needed, each measured on it (and harmless elsewhere):
- RUN steps in `--isolation chroot`: crun refuses the host's hybrid cgroup v1/v2 layout
  ("cgroups in hybrid mode not supported"); runc-run containers work;
- `--format docker`: the OCI image format has no HEALTHCHECK;
- containers run by runc with RLIMIT_NOFILE and RLIMIT_NPROC lowered: without CAP_SYS_RESOURCE
  runc cannot set podman's defaults ("error setting rlimit type 7: operation not permitted");
- host networking, so that no CNI network has to be set up.
The base stands in for each Dockerfile's FROM image under that image's own name, only for the
build and only where no image of that name is here already (never for one pulled for real).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dockerfiles import base_images

LOCAL_BASE = "localhost/tandem-base:debian-bookworm"
DEBIAN_SUITE = "bookworm"
BUILD_TIMEOUT_S = 1800
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CONTAINER_CA_BUNDLE = "/etc/ssl/host-ca.crt"
WHEELHOUSE = "/wheelhouse"  # where the build's RUN steps see the local torch wheel and its dependencies
BUILD_FLAGS = ("--isolation", "chroot", "--format", "docker", "--layers", "--pull=never")
RUN_FLAGS = ("--runtime", "runc", "--network", "host", "--ulimit", "nofile=4096:4096",
             "--ulimit", "nproc=4096:4096")
TOOLS = ("buildah", "podman", "runc", "debootstrap")


class CannotBuildHere(Exception):
    """Why images cannot be built on this machine (the tests skip with it)."""


def run(*command: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def image_exists(name: str) -> bool:
    return run("podman", "image", "exists", name).returncode == 0


def qualified(name: str) -> str:
    """`debian:bookworm-slim` as podman stores it: docker.io/library/debian:bookworm-slim."""
    first = name.split("/")[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return "docker.io/" + (name if "/" in name else f"library/{name}")


def make_local_base(workdir: Path) -> str:
    """LOCAL_BASE, debootstrapped from Debian's packages unless it is here already."""
    if image_exists(LOCAL_BASE):
        return LOCAL_BASE
    if os.geteuid() != 0:
        raise CannotBuildHere("debootstrap and rootful buildah need root")
    rootfs = workdir / "rootfs"
    result = run("debootstrap", "--variant=minbase", DEBIAN_SUITE, str(rootfs), timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise CannotBuildHere(f"debootstrap failed: {(result.stdout + result.stderr)[-2000:]}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = run("podman", "import", "-", LOCAL_BASE, stdin=tar.stdout)
    tar.wait()
    if imported.returncode != 0:
        raise CannotBuildHere(f"podman import failed: {imported.stderr[-2000:]}")
    return LOCAL_BASE


@contextmanager
def stand_in_bases(dockerfile: Path):
    """LOCAL_BASE tagged as each of the Dockerfile's base images that is not here, untagged after."""
    added = [name for name in map(qualified, sorted(base_images(dockerfile))) if not image_exists(name)]
    for name in added:
        run("podman", "tag", LOCAL_BASE, name).check_returncode()
    try:
        yield added
    finally:
        for name in added:
            run("podman", "untag", LOCAL_BASE, name)


def cpu_torch_wheelhouse(torch_pin: str, workdir: Path) -> Path:
    """torch's CPU build and its dependencies as pip here finds them, with a PEP 503 index
    (`simple/`) for the CPU Dockerfile's TORCH_INDEX_URL. CannotBuildHere when pip here offers
    only another build of torch."""
    report = run(sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps",
                 "--report", "-", torch_pin)
    if report.returncode != 0:
        raise CannotBuildHere(f"pip finds no {torch_pin}: {report.stderr[-1000:]}")
    (item,) = json.loads(report.stdout)["install"]
    if "+cpu" not in item["metadata"]["version"]:
        raise CannotBuildHere(f"pip here offers {torch_pin} as {item['download_info']['url'].rsplit('/', 1)[-1]}, "
                              "not torch's CPU build, which the CPU image installs from torch's own index")
    wheelhouse = workdir / "wheelhouse"
    download = run(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(wheelhouse),
                   torch_pin, timeout=BUILD_TIMEOUT_S)
    if download.returncode != 0:
        raise CannotBuildHere(f"pip download {torch_pin} failed: {download.stderr[-1000:]}")
    write_simple_index(wheelhouse)
    return wheelhouse


def write_simple_index(wheelhouse: Path) -> None:
    """simple/<project>/index.html linking each wheel, the layout pip reads from a file:// index."""
    for wheel in wheelhouse.glob("*.whl"):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        page = wheelhouse / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        links = page.read_text() if page.exists() else ""
        page.write_text(links + f'<a href="../../{wheel.name}">{wheel.name}</a>\n')


def pip_config(workdir: Path) -> Path:
    """A pip.conf for the build's RUN steps: the wheelhouse, and this host's CA bundle (pip's own
    bundle does not know a proxy's CA)."""
    lines = ["[global]", f"find-links = {WHEELHOUSE}"]
    if HOST_CA_BUNDLE.exists():
        lines.append(f"cert = {CONTAINER_CA_BUNDLE}")
    path = workdir / "pip.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def build(dockerfile: Path, tag: str, context: Path, wheelhouse: Path, workdir: Path,
          build_args: dict[str, str]) -> subprocess.CompletedProcess:
    mounts = ["-v", f"{wheelhouse}:{WHEELHOUSE}:ro", "-v", f"{pip_config(workdir)}:/etc/pip.conf:ro"]
    if HOST_CA_BUNDLE.exists():
        mounts += ["-v", f"{HOST_CA_BUNDLE}:{CONTAINER_CA_BUNDLE}:ro"]
    args = [item for name, value in build_args.items() for item in ("--build-arg", f"{name}={value}")]
    with stand_in_bases(dockerfile):
        return run("buildah", "bud", *BUILD_FLAGS, *mounts, *args, "-f", str(dockerfile), "-t", tag, str(context),
                   timeout=BUILD_TIMEOUT_S)


def remove_build_leftovers(tag: str | None = None) -> None:
    """The tagged image, the untagged stage and layer images that `--layers` keeps, and any working
    container a failed build left: each build leaves about 3 GB, and repeated runs filled the disk."""
    if tag is not None:
        run("buildah", "rmi", "-f", tag)
    run("buildah", "rm", "--all")
    run("buildah", "rmi", "--prune", timeout=BUILD_TIMEOUT_S)


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tandem-images-"))

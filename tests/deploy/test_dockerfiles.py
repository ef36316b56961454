"""Both Dockerfiles lint clean with hadolint, copy only what the build context holds, and install the lock."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import dockerfiles, runtime_lock
from tests.deploy.rendering import ROOT

HADOLINT = Path(sys.executable).parent / "hadolint"


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = _hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The linter run above is live: an unpinned base and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install flask\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_every_hadolint_exception_is_justified(dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        match = re.search(r"hadolint ignore=(\S+)(.*)", line)
        if match:
            assert len(match.group(2).strip()) > 10, f"unjustified hadolint exception: {line}"


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_are_in_the_build_context(dockerfile: Path) -> None:
    context = dockerfiles.build_context(ROOT)
    for copy in dockerfiles.copies(dockerfile):
        if copy.from_stage:
            continue
        for source in copy.sources:
            source = source.rstrip("/")
            assert source in context or any(f.startswith(source + "/") for f in context), (
                f"{dockerfile.name}: COPY {source} is missing from the build context (.dockerignore?)")


def test_build_context_is_small_and_holds_no_secrets_or_caches() -> None:
    rules = dockerfiles.ignore_rules(ROOT)
    for path in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_rbac.py", "gpuplugin/__pycache__/cli.pyc",
                 "bench/results/x.json", "deploy/manifests/kustomization.yaml"):
        assert dockerfiles.is_ignored(path, rules), path
    for path in ("pyproject.toml", "gpuplugin/cli.py", "extender/app.py", "deploy/requirements-runtime.txt",
                 "gputopo/data/dgx1-v100-hybrid-cube-mesh.txt"):
        assert not dockerfiles.is_ignored(path, rules), path


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_image_shape(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    lines = dockerfiles.logical_lines(text)
    froms = [line.split() for line in lines if line.upper().startswith("FROM ")]
    assert [f[-1] for f in froms] == ["build", "runtime"], "two stages: build, runtime"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", text, re.M), "slim base pinned by tag"
    runtime_copies = [c for c in dockerfiles.copies(dockerfile) if c.stage == "runtime"]
    assert runtime_copies == [], "the runtime stage takes nothing from the context (wheels come by bind mount)"
    runtime_runs = [cmd for stage, cmd in dockerfiles.run_commands(dockerfile) if stage == "runtime"]
    assert any("--no-index" in cmd and "/wheels/gpu_topology_scheduling-" in cmd for cmd in runtime_runs)
    assert any("pip uninstall --yes pip setuptools wheel" in cmd for cmd in runtime_runs)
    assert not re.search(r"apt-get install|gcc|build-essential", text), "no build tools"
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "last USER is unprivileged"
    for label in ("title", "description", "version", "revision", "source"):
        assert f"org.opencontainers.image.{label}=" in text
    build_runs = [cmd for stage, cmd in dockerfiles.run_commands(dockerfile) if stage == "build"]
    assert any("--requirement deploy/requirements-runtime.txt" in cmd for cmd in build_runs)
    assert any("--no-deps" in cmd and cmd.rstrip().endswith(" .") for cmd in build_runs)


def test_plugin_image_documents_the_nvidia_toolkit_variables() -> None:
    text = (ROOT / "Dockerfile.plugin").read_text()
    assert re.search(r"NVIDIA_VISIBLE_DEVICES=all", text)
    assert re.search(r"NVIDIA_DRIVER_CAPABILITIES=utility", text)
    assert "libnvidia-ml" in text


def test_runtime_lock_is_current() -> None:
    """deploy/requirements-runtime.txt pins exactly the tested environment's runtime closure."""
    locked = runtime_lock.parse_lock(runtime_lock.LOCK_FILE.read_text())
    assert locked == runtime_lock.runtime_closure(), (
        "regenerate: .venv/bin/python -m tests.deploy.runtime_lock > deploy/requirements-runtime.txt")

"""The Dockerfile lints clean with hadolint, copies only what the build context holds, installs the lock, works
behind a proxy, and labels the image with the project's real source URL."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from deploy.image import prune, source_url
from tests.deploy import dockerfiles, runtime_lock
from tests.deploy.rendering import ROOT, all_renderings, containers

HADOLINT = Path(sys.executable).parent / "hadolint"
DOCKERFILE = dockerfiles.DOCKERFILE
TEXT = DOCKERFILE.read_text()


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing() -> None:
    result = _hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The linter run above is live: an unpinned base and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install flask\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3013" in result.stdout


def test_every_hadolint_exception_is_justified() -> None:
    for line in TEXT.splitlines():
        match = re.search(r"hadolint ignore=(\S+)(.*)", line)
        if match:
            assert len(match.group(2).strip()) > 10, f"unjustified hadolint exception: {line}"


def test_copied_sources_are_in_the_build_context() -> None:
    context = dockerfiles.build_context(ROOT)
    for copy in dockerfiles.copies(DOCKERFILE):
        if copy.from_stage:
            continue
        for source in copy.sources:
            source = source.rstrip("/")
            assert source in context or any(f.startswith(source + "/") for f in context), (
                f"COPY {source} is missing from the build context (.dockerignore?)")


def test_build_context_is_small_and_holds_no_secrets_or_caches() -> None:
    rules = dockerfiles.ignore_rules(ROOT)
    for path in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_rbac.py", "gpuplugin/__pycache__/cli.pyc",
                 "bench/results/x.json", "deploy/manifests/kustomization.yaml", "scripts/build_image.sh"):
        assert dockerfiles.is_ignored(path, rules), path
    for path in ("pyproject.toml", "gpuplugin/cli.py", "extender/http/app.py", "deploy/requirements-runtime.txt",
                 "gputopo/data/dgx1-v100-hybrid-cube-mesh.txt", "deploy/image/prune.py", "LICENSE"):
        assert not dockerfiles.is_ignored(path, rules), path


def test_image_shape() -> None:
    lines = dockerfiles.logical_lines(TEXT)
    froms = [line.split() for line in lines if line.upper().startswith("FROM ")]
    assert [f[-1] for f in froms] == ["build", "runtime"], "two stages: build, runtime"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", TEXT, re.M), "slim base pinned by tag"
    runtime_copies = [c for c in dockerfiles.copies(DOCKERFILE) if c.stage == "runtime"]
    assert runtime_copies == [dockerfiles.Copy("runtime", ("/opt/gpu-topology",), "/opt/gpu-topology", "build")], \
        "the runtime stage takes only the pruned environment, nothing from the context"
    runtime_runs = [cmd for stage, cmd in dockerfiles.run_commands(DOCKERFILE) if stage == "runtime"]
    assert any("pip uninstall --yes" in cmd and "pip setuptools wheel" in cmd for cmd in runtime_runs)
    assert not re.search(r"apt-get install|gcc|build-essential", TEXT), "no build tools"
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "last USER is unprivileged"
    for label in ("title", "description", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in TEXT
    build_runs = [cmd for stage, cmd in dockerfiles.run_commands(DOCKERFILE) if stage == "build"]
    assert any("--no-deps --requirement deploy/requirements-runtime.txt" in " ".join(cmd.split()) for cmd in build_runs)
    assert any("--no-deps ." in cmd and "deploy/image/prune.py" in cmd for cmd in build_runs)
    assert not re.search(r"^ENTRYPOINT", TEXT, re.M), "no entrypoint: each pod's command picks the binary"


def test_one_image_serves_both_binaries_and_the_pods_pick_them() -> None:
    """Every workload of every rendering runs the one image; the plugin container runs gpuplugin, the extender
    gpu-extender, and only the plugin's pod asks the NVIDIA runtime for GPUs."""
    assert "NVIDIA_VISIBLE_DEVICES" not in "\n".join(dockerfiles.logical_lines(TEXT)), \
        "the image must not ask for GPUs: the extender runs from it too"
    for name, objects in all_renderings().items():
        ours = {c["image"] for o in objects for _, c in containers(o) if c["name"] in ("plugin", "extender")}
        assert len(ours) == 1, f"{name}: {ours}"
        for obj in objects:
            for _, container in containers(obj):
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                if container["name"] == "plugin":
                    assert container["command"] == ["gpuplugin"] and container["args"][0] == "run"
                    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
                elif container["name"] == "extender":
                    assert container["command"] == ["gpu-extender"] and container["args"][0] == "serve"
                    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_build_behind_a_proxy_takes_the_ca_bundle_and_index_as_secrets() -> None:
    """Every pip run of the build goes through deploy/image/pip.sh with both secret mounts, optional."""
    pip_runs = [line for line in dockerfiles.logical_lines(TEXT) if "pip.sh" in line and line.startswith("RUN")]
    assert len(pip_runs) == 2
    for line in pip_runs:
        assert "--mount=type=secret,id=ca_bundle,required=false" in line
        assert "--mount=type=secret,id=pip_index_url,required=false" in line
    assert not re.search(r"^\s*RUN[^\n]*\bpip (install|wheel|download)", TEXT, re.M), "pip without the proxy settings"
    script = (ROOT / "deploy" / "image" / "pip.sh").read_text()
    assert "PIP_CERT=/run/secrets/ca_bundle" in script and "/run/secrets/pip_index_url" in script


def test_pip_wrapper_exports_the_secrets(tmp_path: Path) -> None:
    """pip.sh hands pip the CA bundle and the index from the secret files, and nothing when they are absent."""
    fake_pip = tmp_path / "bin" / "pip"
    fake_pip.parent.mkdir()
    fake_pip.write_text('#!/bin/sh\necho "cert=${PIP_CERT:-} index=${PIP_INDEX_URL:-} args=$*"\n')
    fake_pip.chmod(0o755)
    script = (ROOT / "deploy" / "image" / "pip.sh").read_text().replace("/run/secrets", str(tmp_path / "secrets"))
    wrapper = tmp_path / "pip.sh"
    wrapper.write_text(script)
    env = {"PATH": f"{fake_pip.parent}:/usr/bin:/bin"}
    run = lambda: subprocess.run(["sh", str(wrapper), "install", "x"], env=env, capture_output=True,  # noqa: E731
                                 text=True, check=True).stdout.strip()
    assert run() == "cert= index= args=install x"
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "ca_bundle").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "secrets" / "pip_index_url").write_text("https://user:token@mirror.example/simple")
    assert run() == (f"cert={tmp_path}/secrets/ca_bundle index=https://user:token@mirror.example/simple "
                     "args=install x")


def test_source_label_comes_from_the_one_url_in_pyproject() -> None:
    url = source_url.source_url()
    assert url.startswith("https://") and "example" not in url and "invalid" not in url
    assert 'org.opencontainers.image.source="${SOURCE_URL}"' in TEXT
    assert 'source_url.py --check "${SOURCE_URL}"' in TEXT
    assert source_url.main(["--check", url]) == 0
    assert source_url.main(["--check", ""]) == 1
    assert source_url.main(["--check", "https://example.invalid/x"]) == 1
    # Nowhere else in the repository spells it (the build script and docs ask source_url.py).
    spelled = subprocess.run(["git", "grep", "--untracked", "-lF", url], cwd=ROOT, capture_output=True, text=True)
    assert spelled.stdout.split() == ["pyproject.toml"]


def test_prune_list_is_exactly_what_only_kubernetes_aio_needs() -> None:
    """deploy/image/prune.py removes the distributions nothing needs once kubernetes.aio is gone: the runtime
    closure less the closure without kubernetes' aiohttp requirements."""
    closure = set(runtime_lock.runtime_closure())
    without_aio = set(runtime_lock.runtime_closure(skip={("kubernetes", "aiohttp"), ("kubernetes", "aiohttp-retry")}))
    assert sorted(closure - without_aio) == sorted(prune.AIO_ONLY_DISTRIBUTIONS)


def test_runtime_lock_is_current() -> None:
    """deploy/requirements-runtime.txt pins exactly the tested environment's runtime closure."""
    locked = runtime_lock.parse_lock(runtime_lock.LOCK_FILE.read_text())
    assert locked == runtime_lock.runtime_closure(), (
        "regenerate: .venv/bin/python -m tests.deploy.runtime_lock > deploy/requirements-runtime.txt")

"""Dockerfile.plugin and Dockerfile.extender lint clean with hadolint, copy only what the build context holds, install
their own lock, work behind a proxy, label the image with the project's real source URL, and differ only where the
component does; each workload of the chart and kustomize runs its component's image."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.image import prune, source_url
from tests.deploy import dockerfiles, runtime_lock
from tests.deploy.rendering import ROOT, ChartVariant, all_renderings, containers, kustomize_build, render_chart

HADOLINT = Path(sys.executable).parent / "hadolint"
DOCKERFILES = dockerfiles.DOCKERFILES
TEXTS = {component: path.read_text() for component, path in DOCKERFILES.items()}
COMPONENTS = sorted(DOCKERFILES)


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("component", COMPONENTS)
def test_hadolint_finds_nothing(component: str) -> None:
    result = _hadolint(DOCKERFILES[component])
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_combined_image_is_left() -> None:
    """Every workload runs one of the two component images (below), so the one image for both halves is gone."""
    assert not (ROOT / "Dockerfile").exists()
    assert sorted(p.name for p in ROOT.glob("Dockerfile*")) == ["Dockerfile.extender", "Dockerfile.plugin"]


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The linter run above is live: an unpinned base and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install flask\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_hadolint_exception_is_justified(component: str) -> None:
    for line in TEXTS[component].splitlines():
        match = re.search(r"hadolint ignore=(\S+)(.*)", line)
        if match:
            assert len(match.group(2).strip()) > 10, f"unjustified hadolint exception: {line}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_copied_sources_are_in_the_build_context(component: str) -> None:
    context = dockerfiles.build_context(ROOT)
    for copy in dockerfiles.copies(DOCKERFILES[component]):
        if copy.from_stage:
            continue
        for source in copy.sources:
            source = source.rstrip("/")
            assert source in context or any(f.startswith(source + "/") for f in context), (
                f"COPY {source} is missing from the build context (.dockerignore?)")


def test_build_context_is_small_and_holds_no_secrets_or_caches() -> None:
    rules = dockerfiles.ignore_rules(ROOT)
    for path in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_rbac.py", "gpuplugin/__pycache__/cli.pyc",
                 "bench/results/x.json", "deploy/manifests/kustomization.yaml", "scripts/build_image.sh",
                 "deploy/requirements-runtime.txt", "fixtures/topologies/aws-p5.48xlarge.txt"):
        assert dockerfiles.is_ignored(path, rules), path
    for path in ("pyproject.toml", "gpuplugin/cli.py", "extender/http/app.py", "deploy/requirements-plugin.txt",
                 "deploy/requirements-extender.txt",
                 "gputopo/data/dgx1-v100-hybrid-cube-mesh.txt", "deploy/image/prune.py", "LICENSE"):
        assert not dockerfiles.is_ignored(path, rules), path


@pytest.mark.parametrize("component", COMPONENTS)
def test_image_shape(component: str) -> None:
    text, dockerfile = TEXTS[component], DOCKERFILES[component]
    lines = dockerfiles.logical_lines(text)
    froms = [line.split() for line in lines if line.upper().startswith("FROM ")]
    assert [f[-1] for f in froms] == ["build", "runtime"], "two stages: build, runtime"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", text, re.M), "slim base pinned by tag"
    runtime_copies = [c for c in dockerfiles.copies(dockerfile) if c.stage == "runtime"]
    assert runtime_copies == [dockerfiles.Copy("runtime", ("/opt/gpu-topology",), "/opt/gpu-topology", "build")], \
        "the runtime stage takes only the pruned environment, nothing from the context"
    runtime_runs = [cmd for stage, cmd in dockerfiles.run_commands(dockerfile) if stage == "runtime"]
    assert any("pip uninstall --yes" in cmd and "pip setuptools wheel" in cmd for cmd in runtime_runs)
    assert not re.search(r"apt-get install|gcc|build-essential", text), "no build tools"
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "last USER is unprivileged"
    for label in ("title", "description", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text
    assert f'org.opencontainers.image.title="gpu-topology-{component}"' in text
    build_runs = [" ".join(cmd.split()) for stage, cmd in dockerfiles.run_commands(dockerfile) if stage == "build"]
    assert any(f"--no-deps --requirement deploy/requirements-{component}.txt" in cmd for cmd in build_runs), \
        "the image installs its own lock"
    assert not any("requirements-runtime.txt" in cmd for cmd in build_runs), "not the combined lock"
    assert any("--no-deps ." in cmd and f"deploy/image/prune.py /opt/gpu-topology {component}" in cmd
               for cmd in build_runs)
    assert not re.search(r"^ENTRYPOINT", text, re.M), "no entrypoint: each pod's command picks the subcommand"
    assert "NVIDIA_VISIBLE_DEVICES" not in "\n".join(lines), "the image never asks for GPUs; the plugin's pod does"


def test_the_two_dockerfiles_differ_only_in_the_component() -> None:
    """One build, two halves: with the component's names, lock, labels, ports and comments set aside, the
    instructions are the same, so a fix to one cannot miss the other."""
    def neutral(component: str) -> list[str]:
        kept = [line for line in dockerfiles.logical_lines(TEXTS[component])
                if not line.startswith(("LABEL ", "EXPOSE ", "CMD "))]
        return [re.sub(rf"(?<=requirements-){component}(?=\.txt)|(?<=/opt/gpu-topology ){component}$", "COMPONENT",
                       line) for line in kept]
    assert neutral("plugin") == neutral("extender")
    assert re.search(r"^EXPOSE 8080$", TEXTS["plugin"], re.M) and re.search(r"^EXPOSE 8888$", TEXTS["extender"], re.M)
    assert 'CMD ["gpuplugin", "--help"]' in TEXTS["plugin"] and 'CMD ["gpu-extender", "--help"]' in TEXTS["extender"]


def _image_name(image: str) -> str:
    return image.rsplit("/", 1)[-1].rsplit(":", 1)[0]


def test_each_workload_runs_its_components_image() -> None:
    """The plugin's containers (device plugin, DRA driver) run the plugin image, the extender's and the webhook's the
    extender image, in every rendering of the chart and kustomize; only the plugin's pods ask the NVIDIA runtime for
    GPUs."""
    renderings = {**all_renderings(),
                  "helm:dra": render_chart(ChartVariant("gpu-topology", "gpu-topology", {"dra": {"enabled": True}})),
                  "kustomize:deploy/webhook": kustomize_build(ROOT / "deploy" / "webhook")}
    seen: set[str] = set()
    for name, objects in renderings.items():
        for obj in objects:
            for _, container in containers(obj):
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                command = (container.get("command") or [""])[0]
                if command == "gpuplugin":
                    assert _image_name(container["image"]) == "gpu-topology-plugin", (name, container["image"])
                    assert container["args"][0] in ("run", "dra", "mps-control", "cleanup")
                    seen.add(f"plugin {container['args'][0]}")
                    if container["args"][0] == "cleanup":  # the uninstall hook: an API client, no GPU
                        assert "NVIDIA_VISIBLE_DEVICES" not in env
                        continue
                    # the driver's compute part only where MPS daemons run (the control program comes with it)
                    mps = container["args"][0] == "mps-control" or (
                        container["args"][0] == "run" and any(a.startswith("--mps-root") for a in container["args"]))
                    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
                    assert env["NVIDIA_DRIVER_CAPABILITIES"] == ("compute,utility" if mps else "utility")
                    seen.add(f"plugin {container['args'][0]}")
                elif command == "gpu-extender":
                    assert _image_name(container["image"]) == "gpu-topology-extender", (name, container["image"])
                    assert container["args"][0] in ("serve", "webhook")
                    assert "NVIDIA_VISIBLE_DEVICES" not in env
                    seen.add(f"extender {container['args'][0]}")
                else:
                    assert "gpu-topology" not in container["image"], (name, container["name"], container["image"])
    assert seen == {"plugin run", "plugin dra", "plugin mps-control", "plugin cleanup", "extender serve",
                    "extender webhook"}, seen


@pytest.mark.parametrize("component", COMPONENTS)
def test_build_behind_a_proxy_takes_the_ca_bundle_and_index_as_secrets(component: str) -> None:
    """Every pip run of the build goes through deploy/image/pip.sh with both secret mounts, optional."""
    text = TEXTS[component]
    pip_runs = [line for line in dockerfiles.logical_lines(text) if "pip.sh" in line and line.startswith("RUN")]
    assert len(pip_runs) == 2
    for line in pip_runs:
        assert "--mount=type=secret,id=ca_bundle,required=false" in line
        assert "--mount=type=secret,id=pip_index_url,required=false" in line
    assert not re.search(r"^\s*RUN[^\n]*\bpip (install|wheel|download)", text, re.M), "pip without the proxy settings"
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


def test_source_label_defaults_to_the_url_in_pyproject() -> None:
    """Unset or empty SOURCE_URL labels the image with pyproject.toml's URL (the Dockerfiles' default, kept equal to
    it here, since a Dockerfile cannot read a file for a label); the build-stage check runs on the same argument."""
    url = source_url.source_url()
    assert url.startswith("https://") and "example" not in url and "invalid" not in url
    for text in TEXTS.values():
        assert f'org.opencontainers.image.source="${{SOURCE_URL:-{url}}}"' in text
        assert 'source_url.py --check "${SOURCE_URL}"' in text
    # Nowhere else in the repository spells it (the build script and docs ask source_url.py).
    spelled = subprocess.run(["git", "grep", "--untracked", "-lF", url], cwd=ROOT, capture_output=True, text=True)
    assert sorted(spelled.stdout.split()) == ["Dockerfile.extender", "Dockerfile.plugin", "pyproject.toml"]


def _check(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "deploy" / "image" / "source_url.py"), "--check", url],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("url", ["", "https://github.com/someone/gpu-topology-scheduling",
                                 "https://gitlab.example.org:8443/group/sub/fork.git"])
def test_source_url_check_accepts_the_default_and_any_forks_https_url(url: str) -> None:
    result = _check(url)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == f"OCI source label: {url or source_url.source_url()}" + (
        " (pyproject.toml [project.urls] Source)\n" if not url else "\n")


@pytest.mark.parametrize("url", ["not a url", "github.com/someone/fork", "http://github.com/someone/fork",
                                 "https://", "https://user:token@github.com/someone/fork", "https://github.com:0/x",
                                 "https://github.com/x?y=1", "https://bad_host/x", "javascript:alert(1)"])
def test_source_url_check_refuses_garbage_with_one_line(url: str) -> None:
    result = _check(url)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("SOURCE_URL must be an https URL"), \
        result.stderr


def test_prune_list_is_exactly_what_only_kubernetes_aio_needs() -> None:
    """deploy/image/prune.py removes the distributions nothing needs once kubernetes.aio is gone: in each image, its
    closure less the closure without kubernetes' aiohttp requirements."""
    aio = {("kubernetes", "aiohttp"), ("kubernetes", "aiohttp-retry")}
    for name in (*COMPONENTS, "runtime"):
        extras = runtime_lock.LOCKS[name][0]
        closure = set(runtime_lock.runtime_closure(extras=extras))
        without_aio = set(runtime_lock.runtime_closure(extras=extras, skip=aio))
        assert sorted(closure - without_aio) == sorted(prune.AIO_ONLY_DISTRIBUTIONS), name


def test_prune_keeps_each_half_and_drops_the_other() -> None:
    """What prune.py keeps of the product per image: the shared library and its own half; the libraries it proves
    absent are the other half's, which the image's lock indeed lacks."""
    assert set(prune.COMPONENTS) == set(DOCKERFILES)
    assert prune.COMPONENTS["plugin"].packages == ("gputopo", "gpuplugin")
    assert prune.COMPONENTS["extender"].packages == ("gputopo", "extender")
    top_level = {"fastapi": "fastapi", "uvicorn": "uvicorn", "starlette": "starlette", "pynvml": "nvidia-ml-py",
                 "grpc": "grpcio", "google.protobuf": "protobuf", "watchdog": "watchdog"}
    for name, component in prune.COMPONENTS.items():
        locked = runtime_lock.parse_lock(runtime_lock.lock_file(name).read_text())
        assert component.absent and not {top_level[m] for m in component.absent} & set(locked), name


@pytest.mark.parametrize("name", ["runtime", *COMPONENTS])
def test_locks_are_current(name: str) -> None:
    """deploy/requirements-runtime.txt pins exactly the tested environment's runtime closure (base and every extra),
    and each image's lock is its half's closure at those pins."""
    combined = runtime_lock.parse_lock(runtime_lock.LOCK_FILE.read_text())
    expected = runtime_lock.runtime_closure() if name == "runtime" else runtime_lock.image_lock(name, combined)
    text = runtime_lock.lock_file(name).read_text()
    assert text == runtime_lock.render_lock(expected, name), (
        f"regenerate: .venv/bin/python -m tests.deploy.runtime_lock {name} > deploy/requirements-{name}.txt")


def test_each_image_lock_is_its_half_of_the_combined_lock() -> None:
    """The image locks are cut from the one lock (same pins, nothing the one lock lacks), together cover it but for
    the demo's own dependencies, and neither holds the other half's libraries."""
    combined = runtime_lock.parse_lock(runtime_lock.LOCK_FILE.read_text())
    plugin, extender = (runtime_lock.parse_lock(runtime_lock.lock_file(n).read_text()) for n in ("plugin", "extender"))
    for lock in (plugin, extender):
        assert all(combined.get(name) == version for name, version in lock.items())
    assert {"grpcio", "protobuf", "nvidia-ml-py", "watchdog"} <= set(plugin)
    assert not {"fastapi", "uvicorn", "starlette"} & set(plugin)
    assert {"fastapi", "uvicorn", "starlette"} <= set(extender)
    assert not {"grpcio", "protobuf", "nvidia-ml-py", "watchdog"} & set(extender)
    demo_only = set(runtime_lock.runtime_closure()) - set(plugin) - set(extender)
    assert "httpx" in demo_only and not demo_only & {"kubernetes", "numpy", "pydantic"}

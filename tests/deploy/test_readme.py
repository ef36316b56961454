"""deploy/README.md names only paths, objects and settings that exist; the top README's offline examples run as
written, from the repository alone (their files are under fixtures/, never beside the clone)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.deploy.rendering import DEPLOY, MANIFESTS, ROOT, SCHEDULER_DIR, find, kustomize_build

README = (DEPLOY / "README.md").read_text()
TOP_README = (ROOT / "README.md").read_text()


def offline_examples() -> list[list[str]]:
    """The `gpuplugin` commands of the top README's bash blocks that end on their own and need neither a GPU nor a
    placeholder filled in (`FILE`, `<registry>`); `serve`, `run` and `dra` are servers, `nvidia-smi |` needs a GPU."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", TOP_README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined, as the shell does
            words = shlex.split(line, comments=True)
            if words[:1] != [".venv/bin/gpuplugin"] or words[1] in {"run", "dra", "demo"}:
                continue
            if any(w.isupper() or "<" in w for w in words):
                continue
            commands.append(words[1:])
    return commands


def test_the_readme_has_offline_examples_with_files_in_the_repository() -> None:
    commands = offline_examples()
    assert ["topo"] in commands
    named = [w for c in commands for w in c if "/" in w]
    assert any(w.startswith("fixtures/topologies/") for w in named), commands
    assert any(c[0] == "slices" for c in commands), commands


@pytest.mark.parametrize("command", offline_examples(), ids=" ".join)
def test_each_offline_example_runs_from_the_repository(command: list[str]) -> None:
    for word in command:
        if "/" in word:
            path = (ROOT / word).resolve()
            assert path.is_relative_to(ROOT) and path.is_file(), f"the README names {word}, not in the repository"
    # `python -m` from the repository root runs this checkout's code, as .venv/bin/gpuplugin does in a clone.
    done = subprocess.run([sys.executable, "-m", "gpuplugin.cli", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = {"topo": "NVLink islands", "slices": "kind: ResourceSlice"}.get(command[0], "GPU")
    assert expected in done.stdout, done.stdout


def test_every_path_it_names_exists() -> None:
    # deploy/<name> after `kubectl logs` / `port-forward` is a Deployment, not a path.
    paths = set(re.findall(r"(?<!logs )(?<!port-forward )(?<![/\w])"
                           r"((?:deploy|scripts|tests)/[\w./-]+|Dockerfile(?:\.\w+\b|\b(?!\.)))", README))
    assert paths
    for path in paths:
        path = path.rstrip(".")
        assert (ROOT / path).exists() or (DEPLOY / path).exists(), path
    for relative in re.findall(r"`((?:manifests|helm|scheduler|checkov)/[\w./-]*)`", README):
        assert (DEPLOY / relative).exists(), relative


def test_names_match_the_manifests() -> None:
    second = kustomize_build(MANIFESTS)
    https = kustomize_build(SCHEDULER_DIR)
    (deployment,) = find(https, "Deployment")
    secret = next(v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if "secret" in v)
    assert f"create secret generic {secret}" in README
    for service in find(second, "Service") + find(https, "Service"):
        assert service["metadata"]["name"] in README
    assert "schedulerName: gpu-topology-scheduler" in README
    for key in ("plan", "allreduce-gbps", "topology"):
        assert f"gpu-topology.io/{key}" in README or f"gpu-topology\\.io/{key}" in README

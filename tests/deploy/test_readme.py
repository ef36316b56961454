"""deploy/README.md names only paths, objects and settings that exist; the top README's offline examples run as
written, from the repository alone (their files are under fixtures/, never beside the clone); the top README stays
short; every relative link of README.md and docs/*.md resolves; the user-facing text names no issue of this
project."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.deploy.rendering import DEPLOY, MANIFESTS, ROOT, SCHEDULER_DIR, find, kustomize_build

README = (DEPLOY / "README.md").read_text()
TOP_README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
# The top README is what a newcomer reads first: at most this many bytes, the rest lives in docs/.
TOP_README_MAX_BYTES = 13_000


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


def test_the_top_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= TOP_README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/"


def relative_links(text: str) -> list[str]:
    """The targets of the markdown links and images of a text that point inside the repository: no scheme, no
    bare #anchor; code spans and fenced blocks left out (they hold shell, not links)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page) -> None:
    links = relative_links(page.read_text())
    if page.name == "README.md":
        assert links, "the README links into docs/"
    for target in links:
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"


# "issue 24", "issues 22-24", "(#24)": this project's own tracker. owner/repo#123 (another project's) is allowed.
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w/.-])#\d+\b", re.I)


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_text_names_no_issue_number(page) -> None:
    found = ISSUE_NUMBER.findall(page.read_text())
    assert not found, f"{page.relative_to(ROOT)} names issue numbers: {found}"


def test_the_issue_pattern_tells_ours_from_others() -> None:
    assert ISSUE_NUMBER.search("fixed in issue 24") and ISSUE_NUMBER.search("see #24.")
    assert ISSUE_NUMBER.search("issues 22-24")
    assert not ISSUE_NUMBER.search("NVIDIA/NVSentinel#1485") and not ISSUE_NUMBER.search("page.md#section-2")

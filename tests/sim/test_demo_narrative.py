"""docs/placement.md's demo section states what the demo prints: each line of its example output appears in a run of
the demo with its defaults, and each fact its narrative states (where train-04 and the first 8-GPU pod land, which
nodes were still empty) holds. A change of placement then fails here until the section is rewritten."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO, short_dir

DOC = REPO / "docs" / "placement.md"
LANDED = re.compile(r"^\[(\d+)/\d+\] (\S+) -> (\S+) GPUs ([\d,]+) ")


def section() -> str:
    text = DOC.read_text()
    return text[text.index("## The demo, step by step"):]


def squeeze(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("demo")
    # short: the demo's unix sockets live under TMPDIR, and pytest's temporary directories are too deep for them
    with short_dir("demo-doc-") as tmpdir:
        done = subprocess.run([sys.executable, "-m", "gpuplugin.cli", "demo", "--out", str(out)], cwd=REPO,
                              env=dict(os.environ, TMPDIR=str(tmpdir)), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def landings(output: str) -> list[tuple[str, str, list[int]]]:
    """(pod, node, GPUs) of each pod placed, in arrival order."""
    found = []
    for line in output.splitlines():
        m = LANDED.match(line)
        if m:
            found.append((m.group(2), m.group(3), [int(g) for g in m.group(4).split(",")]))
    return found


def test_every_line_of_the_documented_output_is_printed(demo_output: str) -> None:
    (block,) = re.findall(r"```\n(.*?)```", section(), flags=re.S)
    lines, _, summary = block.partition("...\n")
    printed = set(demo_output.splitlines())
    for line in lines.splitlines():
        assert line in printed, f"docs/placement.md shows {line!r}; the demo printed:\n{demo_output}"
    assert squeeze(summary) in squeeze(demo_output), "the documented summary differs from the demo's"


def test_the_narrative_facts_hold(demo_output: str) -> None:
    text = squeeze(section())
    placed = landings(demo_output)
    where = {pod: (node, gpus) for pod, node, gpus in placed}
    # the first pods fill the A6000 server, the first of them on a bridge pair
    assert where["train-00-2gpu"] == ("a6000-bridges", [0, 1])
    before_04 = [node for pod, node, _ in placed[:[p for p, _, _ in placed].index("train-04-2gpu")]]
    assert set(before_04) == {"a6000-bridges"} and len(before_04) == 4
    # train-04 takes the NVSwitch node while the PCIe-only server and both DGX-1s are empty
    assert where["train-04-2gpu"] == ("p4d-a100-nvswitch", [0, 1])
    assert "`train-04-2gpu` lands on `p4d-a100-nvswitch`" in text
    assert "while `rtx5090-pcie` and both DGX-1s are still empty" in text
    # the PCIe server gets its first pod only when the NVSwitch node has one GPU left
    first_pcie = next(i for i, (_, node, _) in enumerate(placed) if node == "rtx5090-pcie")
    assert placed[first_pcie][0] == "train-08-2gpu"
    on_p4d = sum(len(gpus) for _, node, gpus in placed[:first_pcie] if node == "p4d-a100-nvswitch")
    assert on_p4d == 7  # no pod finished there before train-08 arrived
    assert "`train-08-2gpu` goes to `rtx5090-pcie` only when the NVSwitch node has one GPU left" in text
    # the first 8-GPU pod gets a DGX-1's ring
    assert where["train-10-8gpu"] == ("dgx1-v100-a", list(range(8)))
    assert "`train-10-8gpu`, gets a DGX-1's 40 GB/s ring" in text

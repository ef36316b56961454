"""docs/placement.md's demo section states what the demo prints: each line of its example output appears in a run of
the demo with its defaults, and each fact its narrative states (where train-04, train-08 and the first 8-GPU pod
land, which nodes were still empty, the means by pod size) holds. A change of placement then fails here until the
section is rewritten."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO, short_dir

DOC = REPO / "docs" / "placement.md"
LANDED = re.compile(r"^\[(\d+)/\d+\] (\S+) -> (\S+) GPUs ([\d,]+) (?:([\d.]+) GB/s)?")


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


def bandwidths(output: str) -> dict[int, list[float]]:
    """The estimated all-reduce GB/s of each multi-GPU pod placed, by its number of GPUs."""
    by: dict[int, list[float]] = {}
    for line in output.splitlines():
        m = LANDED.match(line)
        if m and m.group(5):
            by.setdefault(len(m.group(4).split(",")), []).append(float(m.group(5)))
    return by


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
    # once it is full, train-04 takes the PCIe-only server while the NVSwitch node and both DGX-1s stay empty
    assert where["train-04-2gpu"] == ("rtx5090-pcie", [0, 1])
    assert "So `train-04-2gpu` lands on `rtx5090-pcie`" in text
    assert "while `p4d-a100-nvswitch` and both DGX-1s stay empty" in text
    # the next pods join it until it has one GPU left, when train-08 arrives
    first_off = next(i for i, (_, node, _) in enumerate(placed) if i > len(before_04) and node != "rtx5090-pcie")
    assert placed[first_off][0] == "train-08-2gpu"
    on_pcie = [gpus for _, node, gpus in placed[:first_off] if node == "rtx5090-pcie"]
    assert sum(map(len, on_pcie)) == 7 and {len(g) for g in on_pcie} == {1, 2}  # none finished there meanwhile
    assert "`train-08-2gpu` arrives when the RTX 5090 server has one GPU left" in text
    # train-08 breaks a DGX-1's 40 GB/s island, not the NVSwitch node's 240 GB/s one
    assert where["train-08-2gpu"][0] == "dgx1-v100-a"
    assert "so it goes to `dgx1-v100-a`" in text
    before_10 = placed[:[p for p, _, _ in placed].index("train-10-8gpu")]
    assert all(node != "p4d-a100-nvswitch" for _, node, _ in before_10)
    # so the first 8-GPU pod gets the whole NVSwitch node
    assert where["train-10-8gpu"] == ("p4d-a100-nvswitch", list(range(8)))
    assert "The first 8-GPU pod, `train-10-8gpu`, then gets the whole NVSwitch node, a 240 GB/s ring" in text
    # the means the section quotes: by pod size, and weighted by GPUs
    by = bandwidths(demo_output)
    assert f"they average {sum(by[2]) / len(by[2]):.1f} GB/s here" in text
    assert by[8][0] == 240.0 and "the 8-GPU pod gets 240 instead of 40" in text
    weighted = sum(n * g for n, gs in by.items() for g in gs) / sum(n * len(gs) for n, gs in by.items())
    assert f"the mean of the multi-GPU pods rises from 67.0 to {weighted:.1f} GB/s" in text

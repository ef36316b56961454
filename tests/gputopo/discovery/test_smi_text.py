"""`nvidia-smi topo -m` text: every shared fixture, per-family facts, clear errors, and generated matrices."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.core import bandwidth
from gputopo.core.codec import topology_from_json, topology_to_json
from gputopo.core.errors import TopologyParseError
from gputopo.core.topology import LinkKind, Topology
from gputopo.discovery.smi_text import AFFINITY_COLUMNS, infer_nvlink_generation, parse_nvidia_smi_topo
from tests.helpers.paths import SHARED

TOPOLOGIES = SHARED / "topologies"
H200_TEXT = SHARED / "recordings" / "h200x2-vm-nvidia-smi-topo-m.txt"
FIXTURES = [*sorted(TOPOLOGIES.glob("*.txt")), H200_TEXT]

K = LinkKind


def parse_file(name: str, **kwargs: object) -> Topology:
    path = H200_TEXT if name == H200_TEXT.name else TOPOLOGIES / name
    return parse_nvidia_smi_topo(path.read_text(), source=name, **kwargs)  # type: ignore[arg-type]


def smi_token(topo: Topology, i: int, j: int) -> str:
    link = topo.link(i, j)
    return f"NV{link.lanes}" if link.kind.is_nvlink else link.kind.value


def test_fixture_directory_is_the_one_expected() -> None:
    assert len(list(TOPOLOGIES.glob("*.txt"))) >= 19
    assert len([p for p in FIXTURES if "-PARTIAL" in p.name]) == 2


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_every_fixture_parses_and_round_trips(path: Path) -> None:
    text = path.read_text()
    if "-PARTIAL" in path.name:
        with pytest.raises(TopologyParseError, match=r"missing row GPU\d") as err:
            parse_nvidia_smi_topo(text, source=path.name)
        assert err.value.row is not None and err.value.row.startswith("GPU")
        assert path.name in str(err.value)
        return
    topo = parse_nvidia_smi_topo(text, source=path.name)
    header = next(line for line in text.splitlines() if line.split()[:1] == ["GPU0"])
    assert topo.size == sum(1 for w in header.split() if w.startswith("GPU") and w[3:].isdigit())
    assert topo.ids == tuple(f"GPU{i}" for i in range(topo.size))
    assert topology_from_json(topology_to_json(topo)) == topo


def test_partial_files_name_the_missing_row() -> None:
    with pytest.raises(TopologyParseError, match="missing row GPU5") as err:
        parse_file("pcie-8gpu-2socket-pix-phb-k8s53497-PARTIAL.txt")
    assert err.value.row == "GPU5"
    with pytest.raises(TopologyParseError, match="missing row GPU7") as err:
        parse_file("hgx-8gpu-nv8-a800-or-h800-nccl933-PARTIAL.txt")
    assert err.value.row == "GPU7"


# --- facts per family ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx1-v100-ucxpy.txt", "dgx1-v100-pytorch-ddp-bench.txt"])
def test_dgx1_cube_mesh(name: str) -> None:
    topo = parse_file(name)
    assert topo.size == 8
    assert topo.link(0, 3).kind is K.NVLINK and topo.link(0, 3).lanes == 2 and topo.link(0, 3).generation == 2
    assert topo.link(0, 1).lanes == 1
    assert topo.link(0, 5).kind is K.SYS
    assert topo.fabric == "nvlink"
    assert topo.nvlink_islands() == [list(range(8))]
    assert topo.pcie_generation == 3
    # No NUMA column in these old outputs: two CPU affinity groups stand for the two sockets; the pytorch post
    # prints one affinity on every row (a quirk), which tells nothing.
    numa = [None] * 8 if "pytorch" in name else [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.numa_node for g in topo.gpus] == numa
    assert topo.gpus[0].cpu_affinity == "0-19,40-59"
    nics = {nic.name: nic.gpu_links for nic in topo.nics}
    assert sorted(nics) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    pix = {name: [g for g, kind in enumerate(links) if kind is K.PIX] for name, links in nics.items()}
    assert pix == {"mlx5_0": [0, 1], "mlx5_1": [2, 3], "mlx5_2": [4, 5], "mlx5_3": [6, 7]}
    assert nics["mlx5_0"][2] is K.PHB and nics["mlx5_0"][4] is K.SYS


def test_dgx1_ucxpy_affinity_per_socket() -> None:
    topo = parse_file("dgx1-v100-ucxpy.txt")
    assert [g.cpu_affinity for g in topo.gpus] == ["0-19,40-59"] * 4 + ["20-39,60-79"] * 4
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_v100_hybrid_mesh_with_numa_columns() -> None:
    topo = parse_file("v100-sxm2-8gpu-hybridmesh-lmdeploy4423.txt")
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert topo.link(4, 7) == topo.link(0, 3)
    assert topo.link(0, 3).lanes == 2 and topo.link(0, 3).kind is K.NVLINK


def test_dlperf_single_nic() -> None:
    topo = parse_file("hgx1-v100-sxm2-8gpu-dlperf.txt")
    (nic,) = topo.nics
    assert nic.name == "mlx5_0"
    assert nic.gpu_links[:4] == (K.NODE, K.NODE, K.PIX, K.PIX)
    assert set(nic.gpu_links[4:]) == {K.SYS}


def test_c4140_tabs_and_nic() -> None:
    topo = parse_file("dell-c4140-4x-v100-sxm2-nv2-alltoall-nccltests68.txt")
    assert topo.size == 4
    for i in range(4):
        for j in range(4):
            if i != j:
                assert topo.link(i, j).kind is K.NVLINK and topo.link(i, j).lanes == 2
    assert topo.link(0, 1).generation == 2
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0]
    assert topo.gpus[3].cpu_affinity == "0,2,4,6,8,10"
    assert [(n.name, n.gpu_links) for n in topo.nics] == [("mlx5_0", (K.NODE,) * 4)]


@pytest.mark.parametrize("name", ["aws-p4d.24xlarge.txt", "hgx-a100-sxm4-80gb-8gpu-8nic-deepep13.txt"])
def test_a100_nvswitch_numa_two_sockets(name: str) -> None:
    topo = parse_file(name)
    assert topo.fabric == "nvswitch"
    assert {topo.link(i, j) for i in range(8) for j in range(8) if i != j} == {topo.link(0, 1)}
    assert topo.link(0, 1).kind is K.NVSWITCH and topo.link(0, 1).lanes == 12 and topo.link(0, 1).generation == 3
    assert topo.pcie_generation == 4
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4


def test_dgx_a100_ten_nics_from_legend() -> None:
    topo = parse_file("dgx-a100-8gpu-10nic-1mcprddgx05.txt")
    assert [n.name for n in topo.nics] == [f"mlx5_{k}" for k in range(10)]
    assert topo.nics[0].gpu_links[:2] == (K.PXB, K.PXB)
    assert set(topo.nics[8].gpu_links) == {K.SYS}  # storage NICs
    assert [g.numa_node for g in topo.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert topo.gpus[4].cpu_affinity == "112-127,240-255"


def test_pleiades_numa_nodes() -> None:
    topo = parse_file("hgx-a100-8gpu-epyc7763-pleiades.txt")
    assert [g.numa_node for g in topo.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert topo.nics[0].gpu_links == (K.SYS, K.SYS, K.PXB, K.PXB, K.SYS, K.SYS, K.SYS, K.SYS)


def test_p5_h100_nvswitch_pcie5() -> None:
    topo = parse_file("aws-p5.48xlarge.txt")
    assert topo.link(2, 6).kind is K.NVSWITCH and topo.link(2, 6).lanes == 18 and topo.link(2, 6).generation == 4
    assert topo.pcie_generation == 5


def test_gcp_a4_squashed_numa_cells() -> None:
    topo = parse_file("gcp-a4-b200-8gpu-nv18-dranet.txt")
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert topo.gpus[7].cpu_affinity == "56-111,168-223"
    assert topo.link(0, 7).kind is K.NVSWITCH and topo.link(0, 7).generation == 4  # text cannot tell B200
    assert [n.name for n in topo.nics] == [f"mlx5_{k}" for k in range(8)]
    assert topo.nics[0].gpu_links[:4] == (K.PIX, K.PIX, K.NODE, K.NODE)


def test_model_and_explicit_generation_override_inference() -> None:
    b200 = parse_file("gcp-a4-b200-8gpu-nv18-dranet.txt", gpu_model="NVIDIA B200")
    assert b200.link(0, 1).generation == 5 and b200.link(0, 1).kind is K.NVSWITCH
    assert b200.gpus[0].model == "NVIDIA B200"
    assert b200.gbps(0, 1) > parse_file("gcp-a4-b200-8gpu-nv18-dranet.txt").gbps(0, 1)
    forced = parse_file("gcp-a4-b200-8gpu-nv18-dranet.txt", gpu_model="NVIDIA B200", nvlink_generation=4)
    assert forced.link(0, 1).generation == 4
    pcie3 = parse_file("aws-p5.48xlarge.txt", pcie_generation=3)
    assert pcie3.pcie_generation == 3
    with pytest.raises(TopologyParseError, match="NVLink generation 9"):
        parse_file("aws-p5.48xlarge.txt", nvlink_generation=9)
    with pytest.raises(TopologyParseError, match="PCIe generation 2"):
        parse_file("aws-p5.48xlarge.txt", pcie_generation=2)


def test_h200_text_with_tabs_is_direct_nvlink() -> None:
    topo = parse_file(H200_TEXT.name)
    assert topo.size == 2
    link = topo.link(0, 1)
    assert (link.kind, link.lanes, link.generation) == (K.NVLINK, 18, 4)
    assert topo.pcie_generation == 5
    assert [(g.numa_node, g.cpu_affinity) for g in topo.gpus] == [(0, "0-31"), (0, "0-31")]


def test_hgx_h100_four_gpu_direct_nv6() -> None:
    topo = parse_file("hgx-h100-4gpu-nv6-nccl1617.txt")
    assert topo.link(0, 1).kind is K.NVLINK and topo.link(0, 1).lanes == 6 and topo.link(0, 1).generation == 4
    assert [g.numa_node for g in topo.gpus] == [3, 1, 7, 5]
    assert [n.name for n in topo.nics] == ["NIC0", "NIC1", "NIC2", "NIC3"]  # no NIC legend in that post
    assert [n.gpu_links.index(K.PIX) for n in topo.nics] == [0, 1, 2, 3]


def test_leonardo_numa_range_gives_none() -> None:
    topo = parse_file("hgx-a100-4gpu-sxm-64gb-nv4-alltoall-leonardo.txt")
    assert all(g.numa_node is None for g in topo.gpus)
    assert all(g.cpu_affinity == "0" for g in topo.gpus)
    assert topo.link(0, 2).kind is K.NVLINK and topo.link(0, 2).lanes == 4 and topo.link(0, 2).generation == 3
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [n.gpu_links.index(K.PXB) for n in topo.nics] == [0, 1, 2, 3]


def test_rtx5090_pcie_only() -> None:
    topo = parse_file("pcie-8x-rtx5090-2socket-sglang23020.txt")
    assert topo.fabric == "pcie"
    assert topo.link(0, 1).kind is K.NODE and topo.link(0, 4).kind is K.SYS
    assert topo.pcie_generation == bandwidth.DEFAULT_PCIE_GENERATION
    assert topo.gbps(0, 1) > topo.gbps(0, 4)
    assert topo.nvlink_islands() == [[i] for i in range(8)]
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"]
    assert topo.nics[1].gpu_links == (K.NODE,) * 4 + (K.SYS,) * 4


def test_l40s_single_numa_node() -> None:
    topo = parse_file("aws-g6e.12xlarge-4xL40S.txt")
    assert topo.fabric == "pcie" and topo.size == 4
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0]


def test_a6000_bridge_pairs() -> None:
    topo = parse_file("pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt")
    link = topo.link(0, 1)
    assert (link.kind, link.lanes, link.generation) == (K.NVLINK, 4, 3)
    assert topo.nvlink_islands() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.link(0, 2).kind is K.NODE and topo.link(1, 7).kind is K.SYS
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"]
    assert topo.nics[0].gpu_links[6] is K.PHB and topo.nics[0].gpu_links[7] is K.NODE


def test_a100_pcie_nv12_bridge_pairs() -> None:
    topo = parse_file("pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178.txt")
    link = topo.link(2, 3)
    assert (link.kind, link.lanes, link.generation) == (K.NVLINK, 12, 3)
    assert topo.nvlink_islands() == [[0, 1], [2, 3], [4, 5], [6, 7]]


# --- generation inference -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("links", "peers", "gen"),
    [
        (4, 1, 3),
        (4, 3, 1),
        (6, 4, 2),
        (8, 7, 4),
        (12, 7, 3),
        (12, 1, 3),
        (18, 1, 4),
        (18, 3, 4),
        (2, 1, 1),
        (5, 2, 2),
        (10, 2, 3),
        (16, 2, 4),
        (24, 2, 4),
    ],
)
def test_generation_from_lanes(links: int, peers: int, gen: int) -> None:
    assert infer_nvlink_generation(links, peers) == gen


# --- errors on bad input ------------------------------------------------------------------------------------

GOOD = """\
\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV2\tSYS\tPIX\t0-9\t0
GPU1\tNV2\t X \tSYS\tPIX\t0-9\t0
GPU2\tSYS\tSYS\t X \tSYS\t10-19\t1
NIC0\tPIX\tPIX\tSYS\t X
"""


def test_hand_made_good_input() -> None:
    topo = parse_nvidia_smi_topo(GOOD)
    assert topo.link(0, 1).lanes == 2 and topo.link(0, 2).kind is K.SYS
    assert topo.nics[0].name == "NIC0" and topo.nics[0].gpu_links == (K.PIX, K.PIX, K.SYS)


@pytest.mark.parametrize(
    ("text", "row", "column", "words"),
    [
        (GOOD.replace("GPU1\tNV2\t X \tSYS", "GPU1\tNV2\t X \tNODE"), "GPU1", "GPU2", "SYS"),  # asymmetric
        (GOOD.replace("GPU0\t X \tNV2", "GPU0\t X \tNVX"), "GPU0", "GPU1", "unknown link token 'NVX'"),
        (GOOD.replace("\tPIX\t0-9\t0\nGPU1", "\t0-9\t0\nGPU1"), "GPU0", "NIC0", "unknown link token '0-9'"),
        (GOOD.replace("GPU2\tSYS\tSYS\t X \tSYS\t10-19\t1", "GPU2\tSYS\tSYS"), "GPU2", "GPU2", "row ends"),
        (GOOD.replace("\t10-19\t1", "\t10-19\t1\t7"), "GPU2", "NUMA Affinity", "cells after"),
        (GOOD.replace("\t10-19\t1", "\t10-19"), "GPU2", "NUMA Affinity", "affinity cells"),
        (GOOD.replace("NIC0\tPIX\tPIX\tSYS\t X\n", ""), "NIC0", None, "missing row NIC0"),
        (GOOD.replace("GPU1\tNV2\t X \tSYS\tPIX\t0-9\t0\n", ""), "GPU1", None, "missing row GPU1"),
        (GOOD.replace("GPU0\t X \tNV2\tSYS", "GPU0\tNV2\tNV2\tSYS"), "GPU0", "GPU0", "diagonal"),
        (
            GOOD.replace("GPU0\t X \tNV2", "GPU0\t X \tX").replace("GPU1\tNV2", "GPU1\tX"),
            "GPU0",
            "GPU1",
            "off the",
        ),
        (GOOD.replace("NV2", "NV0"), "GPU0", "GPU1", "1 to 18"),
        (GOOD.replace("NV2", "NV" + "9" * 5000), "GPU0", "GPU1", "1 to 18"),
        (GOOD.replace("NV2", "NV٣"), "GPU0", "GPU1", "unknown link token"),
        (
            GOOD.replace("GPU0\t X \tNV2\tSYS\tPIX", "GPU0\t X \tNV2\tSYS\tNV2"),
            "GPU0",
            "NIC0",
            "NVLink NV2 to a NIC",
        ),
        (GOOD.split("\n", 1)[1], "header", None, "no header"),
        ("\tGPU0\tGPU2\n", "header", "GPU2", "expected column GPU1"),
        ("\tGPU0\tGPU1\tCPU Affinity\tBogus\n", "header", "Bogus", "unknown column"),
        ("\tGPU0\tNV4\n", "header", "NV4", "unknown column"),
        ("lorem ipsum dolor\nsit amet\n", "header", None, "no header"),
        ("", "header", None, "no header"),
        ("\n\n  \n", "header", None, "no header"),
    ],
)
def test_bad_input_names_row_and_column(text: str, row: str, column: str | None, words: str) -> None:
    with pytest.raises(TopologyParseError) as err:
        parse_nvidia_smi_topo(text, source="bad.txt")
    message = str(err.value)
    assert words in message
    assert err.value.row == row and f"row {row}" in message
    assert message.startswith("bad.txt")
    if column is not None:
        assert err.value.column == column and f"column {column}" in message


def test_extra_row_and_conflicting_legend() -> None:
    with pytest.raises(TopologyParseError, match="row beyond") as err:
        parse_nvidia_smi_topo(GOOD + "NIC1\tPIX\tPIX\tSYS\tSYS\n")
    assert err.value.row == "NIC1"
    legend = "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC0: mlx5_1\n"
    with pytest.raises(TopologyParseError, match="NIC legend names NIC0 twice"):
        parse_nvidia_smi_topo(GOOD + legend)
    assert parse_nvidia_smi_topo(GOOD + legend.rsplit("\n", 2)[0]).nics[0].name == "mlx5_0"


def test_empty_tab_cell_is_placed_by_tabs() -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tPHB\t\t0\tN/A\n"
        "GPU1\tPHB\t X \t0-7\t0\tN/A\n"
    )
    topo = parse_nvidia_smi_topo(text)
    assert [(g.cpu_affinity, g.numa_node) for g in topo.gpus] == [(None, 0), ("0-7", 0)]
    with pytest.raises(TopologyParseError, match="don't show which is empty") as err:
        parse_nvidia_smi_topo(text.replace("\t", "    "))
    assert err.value.row == "GPU0" and err.value.column == "GPU NUMA ID"
    cut = text.replace("GPU1\tPHB\t X \t0-7\t0\tN/A", "GPU1\tPHB\t X \t0-7\t0\t")
    with pytest.raises(TopologyParseError, match="don't show which is empty") as err:
        parse_nvidia_smi_topo(cut)  # a trailing empty field is what a cut-off line looks like
    assert err.value.row == "GPU1" and err.value.column == "GPU NUMA ID"


def test_preamble_crlf_and_old_soc_token() -> None:
    text = "$ nvidia-smi topo -m\r\n" + GOOD.replace("\n", "\r\n").replace("SYS", "SOC")
    topo = parse_nvidia_smi_topo(text)
    assert topo.link(0, 2).kind is K.SYS


# --- generated matrices -------------------------------------------------------------------------------------

SEPARATORS = st.sampled_from(["\t", " ", "    ", "\t\t", " \t", "   \t "])
PCIE = ["PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def smi_matrices(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 8))
    m = draw(st.integers(0, 3))
    names = [f"GPU{i}" for i in range(n)] + draw(
        st.sampled_from([[f"NIC{k}" for k in range(m)], [f"mlx5_{k}" for k in range(m)]])
    )
    size = n + m
    cells = [["X"] * size for _ in range(size)]
    for i in range(size):
        for j in range(i + 1, size):
            choices = PCIE + [f"NV{k}" for k in range(1, 19)] if j < n else PCIE
            cells[i][j] = cells[j][i] = draw(st.sampled_from(choices))
    columns = draw(st.sampled_from([[], ["CPU Affinity"], ["CPU Affinity", "NUMA Affinity"], list(AFFINITY_COLUMNS)]))
    values = {
        "CPU Affinity": ["0-19,40-59", "0", "N/A", "0,2,4,6"],
        "NUMA Affinity": ["0", "1", "N/A", "0-1"],
        "GPU NUMA ID": ["N/A", "3", "0"],
    }
    affinity = [{c: draw(st.sampled_from(values[c])) for c in columns} for _ in range(n)]
    sep = draw(st.lists(SEPARATORS, min_size=size + 4, max_size=size + 4))
    header = sep[0] + "".join(name + sep[k + 1] for k, name in enumerate(names + columns)).rstrip(" \t")
    lines = [header]
    for i, name in enumerate(names):
        row = [name, *(" X " if c == "X" and draw(st.booleans()) else c for c in cells[i])]
        if i < n:
            row += [affinity[i][c] for c in columns]
        lines.append("".join(cell + sep[k] for k, cell in enumerate(row)).rstrip(" \t"))
    legend = draw(st.booleans())
    if legend and names[n:] and names[n].startswith("NIC"):
        lines += ["", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(m)]
    gen = draw(st.one_of(st.none(), st.sampled_from(sorted(bandwidth.NVLINK_GENERATIONS))))
    return {
        "text": "\n".join(lines) + "\n",
        "n": n,
        "names": names,
        "cells": cells,
        "affinity": affinity,
        "gen": gen,
        "legend": legend,
    }


def _explicit_numa(aff: dict[str, str]) -> int | None:
    for column in ("NUMA Affinity", "GPU NUMA ID"):
        if aff.get(column, "").isdigit():
            return int(aff[column])
    return None


def _expected_numa(affinities: list[dict[str, str]]) -> list[int | None]:
    """Explicit NUMA ids when any row has one; else distinct CPU affinity groups, if there are several."""
    explicit = [_explicit_numa(a) for a in affinities]
    if any(x is not None for x in explicit):
        return explicit
    cpus = [a.get("CPU Affinity", "N/A") for a in affinities]
    if any(c in ("N/A", "") for c in cpus) or len(set(cpus)) < 2:
        return explicit
    order = list(dict.fromkeys(cpus))
    return [order.index(c) for c in cpus]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(smi_matrices())
def test_generated_matrices_round_trip(case: dict) -> None:
    topo = parse_nvidia_smi_topo(case["text"], nvlink_generation=case["gen"])
    n, cells = case["n"], case["cells"]
    assert topo.size == n
    lanes = [[int(c[2:]) if c.startswith("NV") else 0 for c in row[:n]] for row in cells[:n]]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            assert smi_token(topo, i, j) == cells[i][j]
            link = topo.link(i, j)
            if case["gen"] is not None and link.kind.is_nvlink:
                cap = bandwidth.NVLINK_LINKS_PER_GPU[case["gen"]]
                assert link.generation == case["gen"]
                assert (link.kind is K.NVSWITCH) == (sum(lanes[i]) > cap or sum(lanes[j]) > cap)
    assert [g.numa_node for g in topo.gpus] == _expected_numa(case["affinity"][:n])
    for i, gpu in enumerate(topo.gpus):
        aff = case["affinity"][i]
        assert gpu.cpu_affinity == (None if aff.get("CPU Affinity", "N/A") == "N/A" else aff["CPU Affinity"])
    names = case["names"][n:]
    if case["legend"] and names and names[0].startswith("NIC"):
        names = [f"mlx5_{k}" for k in range(len(names))]
    assert [nic.name for nic in topo.nics] == names
    for k, nic in enumerate(topo.nics):
        assert [kind.value for kind in nic.gpu_links] == cells[n + k][:n]
    assert topology_from_json(topology_to_json(topo)) == topo


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bool]:
    """A generated matrix with one mutation; the flag says the mutation removed a header or matrix line."""
    text = draw(smi_matrices())["text"]
    lines = text.split("\n")
    kind = draw(st.sampled_from(["delete", "swap", "truncate", "replace"]))
    # Mostly spare the header: a text without one fails early and tests little.
    first = 0 if draw(st.integers(0, 4)) == 0 else 1
    skip = 0 if first == 0 else len(lines[0]) + 1
    if kind == "delete":
        k = draw(st.integers(first, len(lines) - 1))
        removed_matrix_line = bool(lines[k].strip()) and k < text.split("\n\n")[0].count("\n") + 1
        return "\n".join(lines[:k] + lines[k + 1 :]), removed_matrix_line
    if kind == "swap":
        k = draw(st.integers(first, len(lines) - 1))
        words = lines[k].split() or [""]
        a, b = draw(st.integers(0, len(words) - 1)), draw(st.integers(0, len(words) - 1))
        words[a], words[b] = words[b], words[a]
        lines[k] = draw(SEPARATORS).join(words)
        return "\n".join(lines), False
    if kind == "truncate":
        return text[: draw(st.integers(skip, len(text)))], False
    k = draw(st.integers(skip, len(text) - 1))
    return text[:k] + draw(st.sampled_from(["NVX", "\t", " ", "\n", "X", "NV99", "é", "\x00"])) + text[k + 1 :], False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_give_a_topology_or_a_parse_error(case: tuple[str, bool]) -> None:
    text, removed_matrix_line = case
    try:
        topo = parse_nvidia_smi_topo(text)
    except TopologyParseError as e:
        assert str(e)
        return
    assert not removed_matrix_line, "a matrix line was deleted but the text still parsed"
    assert isinstance(topo, Topology) and topo.size >= 1


# --- size of the annotation ---------------------------------------------------------------------------------


def test_sixteen_gpu_nvswitch_node_with_ten_nics_fits_in_4k() -> None:
    n, m = 16, 10
    names = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(m)]
    header = "\t" + "\t".join([*names, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])
    lines = [header]
    for i, name in enumerate(names):
        cells = []
        for j in range(n + m):
            if i == j:
                cells.append(" X ")
            elif i < n and j < n:
                cells.append("NV6")
            else:
                cells.append("PXB" if (i % n) // 2 == (j % n) // 2 else "SYS")
        if i < n:
            cells += ["0-47,96-143" if i < 8 else "48-95,144-191", str(i // 8), "N/A"]
        lines.append("\t".join([name, *cells]))
    lines += ["", "NIC Legend:", "", *(f"  NIC{k}: mlx5_{k}" for k in range(m))]
    topo = parse_nvidia_smi_topo("\n".join(lines) + "\n")
    assert topo.fabric == "nvswitch" and topo.link(0, 15).generation == 2  # DGX-2: NV6 through NVSwitch
    assert len(topo.nics) == m
    gpus = [
        replace(
            g,
            id=f"GPU-{i:08x}-1815-347d-42f6-f41f43f97e01",
            pci_bus_id=f"00000000:{i + 16:02X}:00.0",
            model="Tesla V100-SXM3-32GB",
            memory_mib=32768,
        )
        for i, g in enumerate(topo.gpus)
    ]
    big = Topology.build(gpus, topo.links, topo.nics, topo.pcie_generation)
    encoded = topology_to_json(big).encode()
    assert len(encoded) <= 4096, len(encoded)
    assert topology_from_json(encoded) == big

"""NIC discovery from a sysfs tree (built here as the kernel lays it out): names, RDMA, rates, path classes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputopo.core.topology import Gpu, Link, LinkKind, Topology
from gputopo.discovery.nics import attach_nics, discover_nics, sysfs_bdf

K = LinkKind
BRIDGE, GPU, IB, ETH = "0x060400", "0x030200", "0x020700", "0x020000"


class FakeSysfs:
    """/sys/devices/pciDDDD:BB/<bridges>/<function> directories, /sys/bus/pci/devices/<bdf> symlinks to them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def add(self, host: str, path: list[str], cls: str, numa: int = 0) -> Path:
        d = self.root / "devices" / host
        for k, bdf in enumerate(path):
            d = d / bdf
            if not d.exists():
                d.mkdir(parents=True)
                (d / "class").write_text(f"{cls if k == len(path) - 1 else BRIDGE}\n")
                (d / "numa_node").write_text(f"{numa}\n")
                os.symlink(d, self.root / "bus" / "pci" / "devices" / bdf)
        return d

    def verbs(self, device: Path, name: str, ports: list[tuple[str, str]]) -> None:
        for k, (state, rate) in enumerate(ports, start=1):
            port = device / "infiniband" / name / "ports" / str(k)
            port.mkdir(parents=True)
            (port / "state").write_text(f"{state}\n")
            (port / "rate").write_text(f"{rate}\n")

    def net(self, device: Path, name: str, speed: str, state: str) -> None:
        d = device / "net" / name
        d.mkdir(parents=True)
        (d / "speed").write_text(f"{speed}\n")
        (d / "operstate").write_text(f"{state}\n")


GPU_IDS = ["00000000:03:00.0", "00000000:07:00.0", "00000000:81:00.0", None, "00000000:EE:00.0"]


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    fs = FakeSysfs(tmp_path / "sys")
    sw = ["0000:00:01.0", "0000:01:00.0"]  # root port, switch upstream port
    fs.add("pci0000:00", [*sw, "0000:02:00.0", "0000:03:00.0"], GPU)  # GPU0 under the switch
    nic0 = fs.add("pci0000:00", [*sw, "0000:02:01.0", "0000:04:00.0"], IB)  # same switch: PIX to GPU0
    fs.verbs(nic0, "mlx5_0", [("4: ACTIVE", "400 Gb/sec (4X NDR)")])
    # GPU1 behind a second switch under the first: PXB to mlx5_0
    fs.add("pci0000:00", [*sw, "0000:02:02.0", "0000:05:00.0", "0000:06:00.0", "0000:07:00.0"], GPU)
    eth = fs.add("pci0000:00", ["0000:00:02.0", "0000:08:00.0"], ETH)  # another root port: PHB
    fs.net(eth, "eth0", "25000", "up")
    nic2 = fs.add("pci0000:40", ["0000:40:01.0", "0000:41:00.0"], IB, numa=0)  # other host bridge, same NUMA: NODE
    fs.verbs(nic2, "mlx5_2", [("4: ACTIVE", "100 Gb/sec (4X EDR)")])
    fs.add("pci0000:80", ["0000:80:01.0", "0000:81:00.0"], GPU, numa=1)  # GPU2 on the other socket
    down = fs.add("pci0000:80", ["0000:80:02.0", "0000:82:00.0"], IB, numa=1)
    fs.verbs(down, "mlx5_1", [("1: DOWN", "400 Gb/sec (4X NDR)")])  # no active port: left out
    vf = fs.add("pci0000:80", ["0000:80:02.0", "0000:82:00.1"], IB, numa=1)
    os.symlink(down, vf / "physfn")  # an SR-IOV virtual function: left out
    dual = fs.add("pci0000:80", ["0000:80:03.0", "0000:83:00.0"], IB, numa=1)
    fs.verbs(dual, "mlx5_3", [("1: DOWN", "400 Gb/sec (4X NDR)"), ("4: ACTIVE", "200 Gb/sec (4X HDR)")])
    hidden = fs.add("pci0000:80", ["0000:80:04.0", "0000:84:00.0"], ETH, numa=1)  # interfaces in another netns
    assert hidden.exists()
    return tmp_path / "sys"


def test_nics_rdma_rates_and_path_classes(sysfs: Path) -> None:
    nics = discover_nics(GPU_IDS, sysfs)
    got = {n.name: (n.rdma, n.link_gbit, n.gpu_links) for n in nics}
    assert got == {
        "mlx5_0": (True, 400.0, (K.PIX, K.PXB, K.SYS, K.SYS, K.SYS)),
        "eth0": (False, 25.0, (K.PHB, K.PHB, K.SYS, K.SYS, K.SYS)),
        "mlx5_2": (True, 100.0, (K.NODE, K.NODE, K.SYS, K.SYS, K.SYS)),
        "mlx5_3": (True, 200.0, (K.SYS, K.SYS, K.PHB, K.SYS, K.SYS)),
        "0000:84:00.0": (False, None, (K.SYS, K.SYS, K.PHB, K.SYS, K.SYS)),
    }
    assert [n.name for n in nics] == ["mlx5_0", "eth0", "mlx5_2", "mlx5_3", "0000:84:00.0"]  # PCI order


def test_attach_gives_gpudirect_to_the_gpu_on_the_nics_switch(sysfs: Path) -> None:
    n = 3
    links = [[None if i == j else Link(K.NVSWITCH, 18, 4) for j in range(n)] for i in range(n)]
    gpus = [Gpu(i, f"GPU-{i}", GPU_IDS[i]) for i in range(n)]
    topo = attach_nics(Topology.build(gpus, links, pcie_generation=5), sysfs)
    assert topo.network_gbps[0] == pytest.approx(50.0)  # 400 Gb/s, GPUDirect (PIX)
    assert topo.network_gbps[1] == pytest.approx(50.0)  # PXB: still GPUDirect
    assert topo.network_gbps[2] < 25.0  # only PHB/SYS NICs: staged through host memory


def test_a_link_that_is_down_or_unknown_degrades_only_itself(sysfs: Path) -> None:
    eth = sysfs / "bus" / "pci" / "devices" / "0000:08:00.0" / "net" / "eth0"
    (eth / "operstate").write_text("down\n")
    (sysfs / "bus" / "pci" / "devices" / "0000:41:00.0" / "numa_node").write_text("garbage\n")
    got = {n.name: (n.link_gbit, n.gpu_links[0]) for n in discover_nics(GPU_IDS, sysfs)}
    assert got["eth0"] == (None, K.PHB)
    assert got["mlx5_2"] == (100.0, K.SYS)  # NUMA unknown: cannot say it is the same node


def test_no_pci_bus_means_no_nics(tmp_path: Path) -> None:
    assert discover_nics(GPU_IDS, tmp_path) == ()
    topo = Topology.build([Gpu(0, "GPU-0")], [[None]])
    assert attach_nics(topo, tmp_path) is topo


@pytest.mark.parametrize(
    ("bus_id", "bdf"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:3b:00.0", "0000:3b:00.0"), ("3B:00.0", "0000:3b:00.0"),
     ("00010000:3B:00.0", "10000:3b:00.0"), ("junk", "junk")],
)
def test_bus_ids_as_sysfs_names_them(bus_id: str, bdf: str) -> None:
    assert sysfs_bdf(bus_id) == bdf

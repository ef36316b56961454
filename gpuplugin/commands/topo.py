"""`gpuplugin topo [FILE]`: what the plugin sees in a machine and what it would pick for every request size."""

from __future__ import annotations

from importlib import resources

import click

from gputopo.core import CoreError, Topology, best_subset
from gputopo.core.blind import blind_pick
from gputopo.discovery.loader import load_topology_file, load_topology_text

DEFAULT_TOPOLOGY = "dgx1-v100-hybrid-cube-mesh.txt"


def load_default() -> Topology:
    text = resources.files("gputopo.data").joinpath(DEFAULT_TOPOLOGY).read_text()
    return load_topology_text(text, source=f"bundled {DEFAULT_TOPOLOGY}")


def load(path: str | None) -> Topology:
    return load_default() if path is None else load_topology_file(path)


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x else "-"


def render(topo: Topology, source: str) -> str:
    n = topo.size
    lines = [
        f"{source}: {n} GPUs, fabric {topo.fabric}, PCIe Gen{topo.pcie_generation}, fingerprint {topo.fingerprint}",
        "",
        "Estimated GB/s per direction (link):",
    ]
    head = "       " + "".join(f"{'GPU' + str(j):>13}" for j in range(n)) + "   NUMA"
    lines.append(head)
    for i in range(n):
        cells = []
        for j in range(n):
            cells.append(f"{'X':>13}" if i == j else f"{topo.gbps(i, j):>7.1f} {topo.link(i, j).label:>5}")
        numa = topo.gpus[i].numa_node
        lines.append(f"GPU{i:<4}" + "".join(cells) + f"   {'-' if numa is None else numa}")
    islands = [isl for isl in topo.nvlink_islands() if len(isl) > 1]
    lines += ["", "NVLink islands: " + (", ".join("{" + ",".join(map(str, isl)) + "}" for isl in islands) or "none")]
    lines += [
        "",
        "Best subset per request size (all-reduce estimate = bottleneck of the best ring, GB/s):",
        f"{'size':>4}  {'best GPUs':<26}{'ours':>8}{'random avg':>12}{'random worst':>14}"
        f"{'lowest-index':>14}{'gain':>7}",
    ]
    everything = list(range(n))
    for size in range(1, n + 1):
        alloc = best_subset(topo, everything, size)
        blind = blind_pick(topo, everything, size)
        gain = f"{alloc.allreduce_gbps / blind.random_mean_gbps:.2f}x" if blind.random_mean_gbps else "-"
        gpus = ",".join(map(str, alloc.gpus))
        lines.append(
            f"{size:>4}  {gpus:<26}{_fmt(alloc.allreduce_gbps):>8}{_fmt(blind.random_mean_gbps):>12}"
            f"{_fmt(blind.random_worst_gbps):>14}{_fmt(blind.lowest_index_gbps):>14}{gain:>7}"
        )
    return "\n".join(lines)


@click.command("topo")
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False, readable=True, allow_dash=True))
def command(file: str | None) -> None:
    """Show a machine's links, NVLink islands and the best GPUs for every request size.

    FILE is `nvidia-smi topo -m` text, an NVML recording or compact topology JSON; '-' reads stdin. Without FILE
    the bundled 8x V100 hybrid cube-mesh (DGX-1 class) is used.
    """
    try:
        if file == "-":
            topo = load_topology_text(click.get_text_stream("stdin").read(), source="stdin")
        else:
            topo = load(file)
    except CoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(render(topo, file or f"bundled {DEFAULT_TOPOLOGY}"))

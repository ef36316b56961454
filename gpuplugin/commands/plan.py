"""`gpuplugin plan`: the allocator's choice for one request, and why (each score component), with both placement
efficiencies of gputopo.core.efficiency: vs the empty node and vs the free set (`--available`)."""

from __future__ import annotations

import json
import sys

import click

from gputopo.core import VS_EMPTY, VS_FREE, CoreError, best_subset, efficiency_vs_empty, efficiency_vs_free
from gputopo.core.allocator import best_possible_gbps


def _indices(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of GPU indices", param_hint=what) from None


class _ExitTwo(click.ClickException):
    exit_code = 2


@click.command("plan")
@click.option(
    "--topology",
    "topology_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True),
    help="nvidia-smi topo -m text, NVML recording or topology JSON.",
)
@click.option("--size", required=True, type=int, help="How many GPUs the request needs.")
@click.option("--available", help="Free GPU indices, e.g. 0,1,4 (default: all).")
@click.option("--must-include", help="GPU indices the answer must contain.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(topology_file: str, size: int, available: str | None, must_include: str | None, as_json: bool) -> None:
    """Choose GPUs for one request and explain the choice."""
    from gpuplugin.commands.topo import load

    try:
        topo = load(topology_file)
        avail = _indices(available, "--available")
        avail = list(range(topo.size)) if avail is None else avail
        must = _indices(must_include, "--must-include") or []
        alloc = best_subset(topo, avail, size, must)
    except CoreError as e:
        raise _ExitTwo(str(e)) from None
    vs_empty = efficiency_vs_empty(topo, alloc.gpus)
    vs_free = efficiency_vs_free(topo, alloc.gpus, avail)
    if as_json:
        out = {
            "gpus": list(alloc.gpus),
            "ids": [topo.gpus[i].id for i in alloc.gpus],
            "allreduce_gbps": alloc.allreduce_gbps,
            "total_gbps": alloc.total_gbps,
            "numa_nodes": alloc.numa_nodes,
            "remainder_quality": alloc.remainder_quality,
            "efficiency_vs_empty_node": round(vs_empty, 4),
            "efficiency_vs_free_set": round(vs_free, 4),
            "optimal": alloc.optimal,
            "bound_gbps": alloc.bound_gbps,
        }
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return
    best_empty = best_possible_gbps(topo, size) if size > 1 else 0.0
    best_free = best_possible_gbps(topo, size, avail) if size > 1 else 0.0
    click.echo(f"GPUs {','.join(map(str, alloc.gpus))}  ({', '.join(topo.gpus[i].id for i in alloc.gpus)})")
    click.echo(
        f"  1. all-reduce estimate  {alloc.allreduce_gbps:.1f} GB/s (best ring bottleneck; best on the empty node "
        f"{best_empty:.1f}, among the free GPUs {best_free:.1f})"
    )
    click.echo(f"     {VS_EMPTY} {vs_empty:.3f}, {VS_FREE} {vs_free:.3f}")
    click.echo(f"  2. total pairwise       {alloc.total_gbps:.1f} GB/s")
    click.echo(f"  3. NUMA nodes spanned   {alloc.numa_nodes}")
    click.echo(
        f"  4. remainder quality    {alloc.remainder_quality:.3f} (sum over sizes 2,4,8 of the best ring the "
        "GPUs left free can form, relative to the empty node)"
    )
    click.echo(f"  search: {'exact' if alloc.optimal else 'heuristic'}, bound {alloc.bound_gbps:.1f} GB/s")

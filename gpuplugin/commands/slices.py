"""`gpuplugin slices`: the ResourceSlices the DRA driver would publish for a machine and an allocation state, as
YAML (the what-if companion of `gpuplugin topo`). A what-if tool like `gpuplugin plan`: plain options, with the
driver's defaults and checks (gpuplugin.dra.settings.DraSettings).

The slices carry fixed names (gpuplugin.dra.slices.slice_name), not the driver's generateName: `kubectl apply`
refuses generateName, and `kubectl create` of generated names twice would leave every device listed twice in the
pool (the allocator then skips it). With fixed names, applying the output for another `--allocated` state
updates the same slices in place.

`kubectl apply` writes a multi-document file one object at a time, so a new state moving a device from one slice
to another would, for a moment, list it in two slices of one pool generation: the scheduler calls such a pool
invalid and fails every pod that could use it. The printed slices therefore carry a generation above any applied
before (milliseconds since the epoch unless `--generation` says otherwise): the scheduler reads only the highest
generation of a pool, so while the apply runs the pool is incomplete (pods wait) and never invalid. The driver,
started later, continues from the highest generation it finds, as it does after its own restarts."""

from __future__ import annotations

import time
from typing import Any

import click
import yaml
from pydantic import ValidationError

from gpuplugin.dra.catalog import Catalog, CatalogError
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.settings import DraSettings, parse_ints
from gpuplugin.dra.slices import slice_name, slice_object
from gputopo.core import CoreError

_DEFAULTS = DraSettings.model_fields


def _problem(err: Any) -> str:
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"--{str(err['loc'][0]).replace('_', '-')}: {message}" if err["loc"] else message


class _ExitTwo(click.ClickException):
    exit_code = 2


def render(settings: DraSettings, catalog: Catalog, allocated: list[str], unhealthy: list[int],
           generation: int = 1) -> str:
    unknown = [name for name in allocated if name not in catalog.devices]
    if unknown:
        raise _ExitTwo(f"--allocated names devices this node does not publish: {', '.join(unknown)}")
    used = [g for name in allocated for g in catalog.devices[name].gpus]
    if len(used) != len(set(used)):
        raise _ExitTwo("--allocated devices share GPUs: the allocator never hands out such a state")
    bad = [g for g in unhealthy if not 0 <= g < catalog.topology.size]
    if bad:
        raise _ExitTwo(f"--unhealthy GPU indices outside 0..{catalog.topology.size - 1}: {bad}")
    planner = PoolPlanner(catalog, taint_key=settings.taint_key, republish=settings.republish)
    contents = planner.wanted(used, unhealthy)
    docs = []
    for index, content in enumerate(contents):
        obj = slice_object(content, driver=settings.driver_name, node=settings.node, generation=generation,
                           count=len(contents))
        obj = {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
               "metadata": {"name": slice_name(index, settings.driver_name, settings.node)},
               "spec": obj["spec"]}
        docs.append(obj)
    head = (f"# {catalog.summary()}; {len(contents)} slices (1 counter set + {len(contents) - 1} device slices)\n"
            f"# allocated: {', '.join(allocated) or 'none'}; unhealthy GPUs: {unhealthy or 'none'}\n"
            f"# pool generation {generation}: apply over an older generation in any order; the scheduler waits "
            "for the whole pool\n")
    return head + yaml.safe_dump_all(docs, sort_keys=False)


@click.command("slices")
@click.option("--topology", "topology_file", required=True, type=click.Path(dir_okay=False),
              help="nvidia-smi topo -m text, NVML recording or topology JSON.")
@click.option("--node-name", required=True, help="The node (pool name and spec.nodeName).")
@click.option("--allocated", default="", help="Devices held by claims, e.g. set-0-1-2-3,gpu-5,one-6.")
@click.option("--unhealthy", default="", help="GPU indices that are unhealthy, e.g. 3,7.")
@click.option("--driver-name", default=_DEFAULTS["driver_name"].default, show_default=True)
@click.option("--set-sizes", default=",".join(map(str, _DEFAULTS["set_sizes"].default)), show_default=True,
              help="Sizes of GPU-set devices.")
@click.option("--max-devices", type=int, default=_DEFAULTS["max_devices"].default, show_default=True)
@click.option("--generation", type=click.IntRange(1, 2**62), default=None,
              help="The pool generation of the printed slices [default: milliseconds since the epoch, so each print "
                   "outranks the slices applied before it].")
@click.option("--republish/--no-republish", default=_DEFAULTS["republish"].default, show_default=True,
              help="The order for this state, or (--no-republish) the empty node's order, which a driver run "
                   "with --no-republish keeps forever.")
def command(topology_file: str, node_name: str, allocated: str, unhealthy: str, driver_name: str, set_sizes: str,
            max_devices: int, generation: int | None, republish: bool) -> None:
    """Print the ResourceSlices the DRA driver would publish, as YAML."""
    from gpuplugin.commands.topo import load

    try:
        settings = DraSettings(node_name=node_name, driver_name=driver_name, max_devices=max_devices,
                               set_sizes=set_sizes, republish=republish)
        catalog = Catalog.build(load(topology_file), settings.set_sizes, settings.max_devices)
        sick = parse_ints(unhealthy, "--unhealthy")
    except ValidationError as e:
        raise _ExitTwo("; ".join(_problem(err) for err in e.errors())) from None
    except (ValueError, CoreError, CatalogError) as e:
        raise _ExitTwo(str(e)) from None
    names = [x.strip() for x in allocated.split(",") if x.strip()]
    click.echo(render(settings, catalog, names, sick, generation or time.time_ns() // 1_000_000), nl=False)

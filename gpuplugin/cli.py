"""`gpuplugin`: one click group. Its own subcommands live in gpuplugin/commands/<name>.py as `command`; other
packages add theirs through the `gpuplugin.commands` entry point group (the simulator adds `demo`), so the node agent
never imports them."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

from gputopo import extras

_BUILTIN = ("topo", "plan", "run", "record", "slices", "dra", "mps-control", "node-template",
            "cleanup")
ENTRY_POINT_GROUP = "gpuplugin.commands"
# The extra each subcommand needs beyond the base install (topo and plan need none). `demo` is the simulator's.
_NEEDS = {"run": "plugin", "record": "plugin", "slices": "plugin", "dra": "plugin", "mps-control": "plugin",
          "node-template": "plugin", "cleanup": "plugin", "demo": "demo"}


def _extensions() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in _BUILTIN}


class _LazyGroup(click.Group):
    """Imports a subcommand only when it runs, so `gpuplugin topo` does not pay for gRPC or the Kubernetes client."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*_BUILTIN, *sorted(_extensions())]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        extra = _NEEDS.get(cmd_name) if cmd_name in self.list_commands(ctx) else None
        stand_in = extras.stand_in("gpuplugin", cmd_name, extra)
        if stand_in is not None:
            return stand_in
        if cmd_name in _BUILTIN:
            return importlib.import_module(f"gpuplugin.commands.{cmd_name.replace('-', '_')}").command
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=cmd_name):
            return ep.load()
        return None


@click.group(cls=_LazyGroup, context_settings={"terminal_width": 100})  # a missing extra's line stays whole
@click.version_option(package_name="gpu-topology-scheduling")
def main() -> None:
    """Topology-aware GPU device plugin: discovery, placement and the kubelet device plugin server."""
    from gputopo.logs import configure_logging

    configure_logging("warning")  # `run` raises it with --log-level


if __name__ == "__main__":
    main()

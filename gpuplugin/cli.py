"""`gpuplugin`: one click group; each subcommand lives in gpuplugin/commands/<name>.py as `command`."""

from __future__ import annotations

import importlib
import importlib.util

import click

_SUBCOMMANDS = ("topo", "plan", "run", "record", "demo")


class _LazyGroup(click.Group):
    """Imports a subcommand only when it runs, so `gpuplugin topo` does not pay for gRPC or the Kubernetes client."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in _SUBCOMMANDS if importlib.util.find_spec(f"gpuplugin.commands.{name}")]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _SUBCOMMANDS or not importlib.util.find_spec(f"gpuplugin.commands.{cmd_name}"):
            return None
        return importlib.import_module(f"gpuplugin.commands.{cmd_name}").command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="gpu-topology-scheduling")
def main() -> None:
    """Topology-aware GPU device plugin: discovery, placement and the kubelet device plugin server."""
    from gpuplugin.logs import configure_logging

    configure_logging("warning")  # `run` raises it with --log-level


if __name__ == "__main__":
    main()

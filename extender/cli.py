"""`gpu-extender serve`: the kube-scheduler extender over HTTP(S), against a cluster or a standalone inventory.

Settings (extender.config): flag > environment GPU_EXTENDER_<FLAG> > YAML --config file > default. Exit codes: 2 for
an invalid setting, a missing or unreadable file among them (the message names the setting and its source); 1 when
it cannot start with what the inventory or kubeconfig holds or cannot listen on its port (checked before the app
starts); 3 when the metrics listener cannot start.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import os
import signal
import sys

import click
import structlog

from extender.config import SETTINGS, ExtenderConfig
from extender.logs import configure_logging
from extender.webhook.command import command as webhook_command
from gputopo import extras

log = structlog.get_logger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005
# The extra each subcommand needs beyond the base install.
_NEEDS = {"serve": "extender", "webhook": "extender"}


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach: localhost and 127.0.0.0/8 or ::1. A hostname other than
    localhost counts as remote, since what it resolves to is not ours to know."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plain_http(host: str, tls: bool, allow_insecure_remote: bool) -> None:
    """The verbs answer for the cluster's scheduling: plain HTTP only where nothing off the machine can call them."""
    if tls or is_loopback(host):
        return
    if allow_insecure_remote:
        log.warning("extender.server.insecure_remote", host=host,
                    hint="plain HTTP on a non-loopback address: anyone who reaches it can bind pods")
        return
    raise click.UsageError(
        f"refusing to serve plain HTTP on {host!r}, which is not a loopback address: anyone who reaches it could "
        "bind pods. Serve HTTPS (--tls-cert and --tls-key, with --tls-client-ca to require client certificates), "
        "listen on 127.0.0.1, or pass --allow-insecure-remote (GPU_EXTENDER_ALLOW_INSECURE_REMOTE=1) when "
        "something else protects the port."
    )


class _Group(click.Group):
    """Marks a subcommand whose extra is not installed in `gpu-extender --help`, as gpuplugin's group does, and
    answers it, any arguments and `--help` included, with one line naming what to install (gputopo.extras)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            stand_in = extras.stand_in("gpu-extender", cmd_name, _NEEDS.get(cmd_name))
            if stand_in is not None:
                return stand_in
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Group, context_settings={"terminal_width": 100})  # a missing extra's line stays whole
@click.version_option(package_name="gpu-topology-scheduling")
def main() -> None:
    """Topology-aware kube-scheduler HTTP extender for GPUs."""


@main.command(epilog=SETTINGS.epilog)
@SETTINGS.command
def serve(config: ExtenderConfig) -> None:
    """Serve POST /filter /prioritize /bind /preempt and GET /healthz /readyz /metrics."""
    _serve(config)


def _stop_on_lost_lease() -> None:
    """A leader that could not renew its Lease has already stopped answering; it exits as on SIGTERM and comes
    back as a standby (the Deployment restarts it). The replica that takes the Lease holds every bound pod's plan
    from its own watches."""
    os.kill(os.getpid(), signal.SIGTERM)


def _serve(config: ExtenderConfig) -> None:

    from extender.http.app import create_app, create_metrics_app
    from extender.http.server import (
        ListenError,
        api_server_config,
        companion_server,
        connection_limits,
        handing_over_server,
        listen_failed,
        listeners,
        serve_beside,
        server_config,
    )
    from extender.metrics import ExtenderMetrics
    from extender.service import Extender
    from extender.state.inventory import InventoryError
    from gputopo.kube import KubeConfigError, make_api_client
    from gputopo.kube.election import ElectionError
    from gputopo.metrics import process_registry

    configure_logging(config.log_level)
    tls = config.tls_cert is not None
    check_plain_http(config.host, tls, config.allow_insecure_remote)
    try:
        metrics = ExtenderMetrics(process_registry())
        if config.inventory:
            ext = Extender.standalone(config.inventory, config, metrics=metrics)
        else:
            kubeconfig = str(config.kubeconfig) if config.kubeconfig else None
            api = make_api_client(kubeconfig=kubeconfig, host=config.api_server)
            ext = Extender.cluster(api, config, metrics=metrics, on_lost_lease=_stop_on_lost_lease)
    except (InventoryError, KubeConfigError, ElectionError) as e:
        raise click.ClickException(str(e)) from None
    # Long-lived state (topologies, inventory, imported modules) never becomes garbage: freezing it keeps the cyclic
    # collector from walking it on every full collection, which otherwise shows as latency spikes.
    gc.collect()
    gc.freeze()
    # The event loop answers filter and prioritize while watch and apiserver threads run Python code: a thread that
    # holds the GIL keeps it up to the switch interval before the loop gets it back, and an answer needs it a few
    # times (read, decide, write). Python's default of 5 ms put up to tens of ms on an answer under bind load.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        sock, metrics_sock = listeners(config.host, config.port, config.metrics_host, config.metrics_port)
    except ListenError as e:
        listen_failed(e)
    limits = connection_limits(config, config.max_body_bytes, "api")
    metrics_server = None
    if metrics_sock is not None:
        metrics_server = companion_server(server_config(
            create_metrics_app(ext), "metrics", config.metrics_host, config.metrics_port, log_level=config.log_level,
            limits=limits, metrics=metrics, keep_alive_s=config.keep_alive_timeout_s))
    log.info("extender.server.listening", host=config.host, port=sock.getsockname()[1], mode=ext.mode, tls=tls,
             mutual_tls=config.tls_client_ca is not None, metrics_port=config.metrics_port or None,
             max_connections=limits.max_connections, header_timeout_s=limits.header_timeout_s,
             body_timeout_s=limits.body_timeout_s)
    api_config = api_server_config(create_app(ext), config, metrics, lifespan="on")
    main_server = handing_over_server(api_config, ext.hand_over)

    async def run() -> None:
        await serve_beside(main_server, metrics_server, [sock], [metrics_sock] if metrics_sock else [])

    with asyncio.Runner(loop_factory=api_config.get_loop_factory()) as runner:
        runner.run(run())


main.add_command(webhook_command)


if __name__ == "__main__":
    main()

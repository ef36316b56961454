"""`gpu-extender serve`: the kube-scheduler extender over HTTP(S), against a cluster or a standalone inventory.

Every flag also reads GPU_EXTENDER_SERVE_<FLAG> from the environment (click's auto_envvar_prefix, which adds the
command's name); --allow-insecure-remote reads GPU_EXTENDER_ALLOW_INSECURE_REMOTE.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click
import structlog

from extender.config import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_ISLAND_PENALTY,
    DEFAULT_ISLAND_SPARE,
    DEFAULT_PREFIX,
    DEFAULT_RESERVATION_TIMEOUT_S,
    DEFAULT_RESOURCE,
    ExtenderConfig,
)
from extender.logs import LEVELS, configure_logging

if TYPE_CHECKING:
    import uvicorn

log = structlog.get_logger(__name__)


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


def _companion_server(config: uvicorn.Config) -> uvicorn.Server:
    """A uvicorn server that leaves the signals to the main server (serve_beside stops it)."""
    import uvicorn

    class CompanionServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return CompanionServer(config)


async def serve_beside(main: uvicorn.Server, companion: uvicorn.Server) -> None:
    """Run both servers in one loop. The companion stops as soon as the main server begins to (a signal, a failed
    start); a companion that cannot start (uvicorn has logged why) stops the main server and the process exits 3."""
    failed: list[SystemExit] = []

    async def run_companion() -> None:
        try:
            await companion.serve()
        except SystemExit as e:
            failed.append(e)
            main.should_exit = True

    async def follow() -> None:
        while not main.should_exit and not task.done():
            await asyncio.sleep(0.1)
        companion.should_exit = True

    task = asyncio.create_task(run_companion())
    follower = asyncio.create_task(follow())
    try:
        await main.serve()
    finally:
        companion.should_exit = True
        await asyncio.gather(task, follower)
    if failed:
        raise failed[0]


@click.group(context_settings={"auto_envvar_prefix": "GPU_EXTENDER"})
@click.version_option(package_name="gpu-topology-scheduling")
def main() -> None:
    """Topology-aware kube-scheduler HTTP extender for GPUs."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8888, show_default=True, type=click.IntRange(0, 65535))
@click.option("--inventory", type=click.Path(dir_okay=False), default=None,
              help="Standalone mode: nodes from this YAML inventory, no apiserver.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
              help="Kubeconfig file (default: in-cluster service account, then KUBECONFIG / ~/.kube/config).")
@click.option("--api-server", default=None, help="Explicit apiserver URL (tests, proxies); no credentials.")
@click.option("--resource-name", default=DEFAULT_RESOURCE, show_default=True)
@click.option("--annotation-prefix", default=DEFAULT_PREFIX, show_default=True)
@click.option("--reservation-timeout", default=DEFAULT_RESERVATION_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Seconds a bound plan holds its GPUs unconfirmed.")
@click.option("--max-body-bytes", default=DEFAULT_BODY_LIMIT, show_default=True, type=click.IntRange(min=1),
              help="Requests larger than this get 413.")
@click.option("--island-penalty", default=DEFAULT_ISLAND_PENALTY, show_default=True,
              type=click.FloatRange(min=0),
              help="Share of a scarce larger NVLink island's GB/s a placement is charged for breaking it; 0 = greedy.")
@click.option("--island-spare", default=DEFAULT_ISLAND_SPARE, show_default=True, type=click.IntRange(min=0),
              help="Equally fast larger islands other nodes must still offer for breaking one to cost nothing.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--tls-client-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Require client certificates signed by this CA (mutual TLS).")
@click.option("--allow-insecure-remote", is_flag=True, default=False, envvar="GPU_EXTENDER_ALLOW_INSECURE_REMOTE",
              help="Allow plain HTTP on a non-loopback --host (refused by default: anyone reaching it could bind "
                   "pods).")
@click.option("--metrics-port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="Also serve GET /metrics /healthz /readyz (only those, plain HTTP) on this port; 0: the API port "
                   "only.")
@click.option("--metrics-host", default="0.0.0.0", show_default=True,
              help="Address of the --metrics-port listener (read-only, nothing secret: reachable for Prometheus "
                   "and the kubelet's probes).")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(LEVELS))
def serve(host: str, port: int, inventory: str | None, kubeconfig: str | None, api_server: str | None,
          resource_name: str, annotation_prefix: str, reservation_timeout: float, max_body_bytes: int,
          island_penalty: float, island_spare: int, tls_cert: str | None, tls_key: str | None,
          tls_client_ca: str | None, allow_insecure_remote: bool,
          metrics_port: int, metrics_host: str, log_level: str) -> None:
    """Serve POST /filter /prioritize /bind /preempt and GET /healthz /readyz /metrics."""
    import uvicorn

    from extender.app import create_app, create_metrics_app
    from extender.inventory import InventoryError
    from extender.metrics import ExtenderMetrics
    from extender.service import Extender
    from gputopo.kube import KubeConfigError, make_api_client
    from gputopo.metrics import process_registry

    configure_logging(log_level)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    check_plain_http(host, bool(tls_cert), allow_insecure_remote)
    if metrics_port and metrics_port == port:
        raise click.UsageError(f"--metrics-port {metrics_port} is the API port: give it a port of its own")
    try:
        config = ExtenderConfig(annotation_prefix=annotation_prefix, resource_name=resource_name,
                                reservation_timeout_s=reservation_timeout, max_body_bytes=max_body_bytes,
                                island_penalty=island_penalty, island_spare=island_spare)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        metrics = ExtenderMetrics(process_registry())
        if inventory:
            ext = Extender.standalone(inventory, config, metrics=metrics)
        else:
            api = make_api_client(kubeconfig=kubeconfig, host=api_server)
            ext = Extender.cluster(api, config, metrics=metrics)
    except (InventoryError, KubeConfigError) as e:
        raise click.ClickException(str(e)) from None
    # Long-lived state (topologies, inventory, imported modules) never becomes garbage: freezing it keeps the cyclic
    # collector from walking it on every full collection, which otherwise shows as latency spikes.
    gc.collect()
    gc.freeze()
    server_config = uvicorn.Config(
        create_app(ext),
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,  # uvicorn's lines go through our structured logging (gputopo.logs)
        access_log=False,
        lifespan="on",
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        ssl_ca_certs=tls_client_ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
    )
    main_server = uvicorn.Server(server_config)
    log.info("extender.server.listening", host=host, port=port, mode=ext.mode, tls=bool(tls_cert),
             mutual_tls=bool(tls_client_ca),
             metrics_port=metrics_port or None)
    if not metrics_port:
        main_server.run()
        return
    metrics_server = _companion_server(uvicorn.Config(
        create_metrics_app(ext), host=metrics_host, port=metrics_port, log_level=log_level, log_config=None,
        access_log=False, lifespan="off",
    ))
    with asyncio.Runner(loop_factory=server_config.get_loop_factory()) as runner:
        runner.run(serve_beside(main_server, metrics_server))


if __name__ == "__main__":
    main()

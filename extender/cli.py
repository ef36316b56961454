"""`gpu-extender serve`: the kube-scheduler extender over HTTP(S), against a cluster or a standalone inventory.

Every flag also reads GPU_EXTENDER_<FLAG> from the environment (click's auto_envvar_prefix).
"""

from __future__ import annotations

import gc
import ssl

import click
import structlog

from extender.config import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_PREFIX,
    DEFAULT_RESERVATION_TIMEOUT_S,
    DEFAULT_RESOURCE,
    ExtenderConfig,
)
from extender.logs import LEVELS, configure_logging

log = structlog.get_logger(__name__)


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
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--tls-client-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Require client certificates signed by this CA (mutual TLS).")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(LEVELS))
def serve(host: str, port: int, inventory: str | None, kubeconfig: str | None, api_server: str | None,
          resource_name: str, annotation_prefix: str, reservation_timeout: float, max_body_bytes: int,
          tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None, log_level: str) -> None:
    """Serve POST /filter /prioritize /bind /preempt and GET /healthz /readyz /metrics."""
    import uvicorn

    from extender.app import create_app
    from extender.inventory import InventoryError
    from extender.service import Extender
    from gpuplugin.kube import KubeConfigError, make_api_client

    configure_logging(log_level)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    try:
        config = ExtenderConfig(annotation_prefix=annotation_prefix, resource_name=resource_name,
                                reservation_timeout_s=reservation_timeout, max_body_bytes=max_body_bytes)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        if inventory:
            ext = Extender.standalone(inventory, config)
        else:
            api = make_api_client(kubeconfig=kubeconfig, host=api_server)
            ext = Extender.cluster(api, config)
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
        access_log=False,
        lifespan="on",
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        ssl_ca_certs=tls_client_ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
    )
    log.info("extender.serve", host=host, port=port, mode=ext.mode, tls=bool(tls_cert), mutual_tls=bool(tls_client_ca))
    uvicorn.Server(server_config).run()


if __name__ == "__main__":
    main()

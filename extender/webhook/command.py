"""`gpu-extender webhook`: the mutating admission webhook over HTTPS, with the extender's listener limits
(extender.http.server: head and body deadlines, a connection cap) and an optional plain-HTTP metrics listener.

Exit codes as `gpu-extender serve`: 2 for an invalid setting (named with its source), 1 when it cannot listen or
load its certificate, 3 when the metrics listener fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import click
import structlog

from extender.logs import configure_logging
from extender.webhook.config import SETTINGS, WebhookConfig

log = structlog.get_logger(__name__)


@click.command("webhook", epilog=SETTINGS.epilog)
@SETTINGS.command
def command(config: WebhookConfig) -> None:
    """Serve the mutating admission webhook (POST /mutate) that sets schedulerName on GPU pods, over HTTPS."""
    import uvicorn

    from extender.http.server import (
        ListenError,
        companion_server,
        connection_limits,
        listen_failed,
        listeners,
        serve_beside,
        server_config,
    )
    from extender.webhook.app import create_app, create_metrics_app
    from extender.webhook.certificates import keep_fresh
    from extender.webhook.metrics import WebhookMetrics
    from extender.webhook.review import Policy
    from gputopo.metrics import process_registry

    configure_logging(config.log_level)
    assert config.tls_cert is not None and config.tls_key is not None  # the settings' own rule
    metrics = WebhookMetrics(process_registry())
    policy = Policy(config.scheduler_name, config.resource_name, config.keys.webhook, config.whole_jobs,
                    config.extra_resources, config.keys, config.topology_affinity, config.replica_resources,
                    config.dra_claims)
    limits = connection_limits(config, config.max_body_bytes, "webhook")
    common = {"log_level": config.log_level, "limits": limits, "metrics": metrics,
              "keep_alive_s": config.keep_alive_timeout_s}
    api_config = server_config(create_app(policy, metrics, config.max_body_bytes), "webhook", config.host,
                               config.port, **common, ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key)
    try:
        api_config.load()  # builds the SSL context now: a bad certificate fails before anything listens
    except (ssl.SSLError, OSError) as e:
        raise click.ClickException(f"cannot load the certificate {config.tls_cert} with key {config.tls_key}: {e}"
                                   ) from None
    context = api_config.ssl
    assert context is not None
    try:
        sock, metrics_sock = listeners(config.host, config.port, config.metrics_host, config.metrics_port)
    except ListenError as e:
        listen_failed(e)
    main_server = uvicorn.Server(api_config)
    metrics_server = None
    if metrics_sock is not None:
        metrics_server = companion_server(server_config(
            create_metrics_app(metrics), "metrics", config.metrics_host, config.metrics_port, **common))
    log.info("extender.webhook.listening", host=config.host, port=sock.getsockname()[1],
             scheduler=config.scheduler_name, resource=config.resource_name, resources=list(policy.resources),
             whole_jobs=policy.whole_jobs, opt_out_label=policy.opt_out_label,
             metrics_port=config.metrics_port or None, max_connections=limits.max_connections)

    async def run() -> None:
        fresh = asyncio.create_task(keep_fresh(context, config.tls_cert, config.tls_key,  # type: ignore[arg-type]
                                               config.certificate_check_s, metrics))
        try:
            await serve_beside(main_server, metrics_server, [sock], [metrics_sock] if metrics_sock else [])
        finally:
            fresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fresh

    with asyncio.Runner(loop_factory=api_config.get_loop_factory()) as runner:
        runner.run(run())

"""Building an ApiClient from whatever credentials this process has.

Explicit arguments win (tests point at a fake apiserver even when run inside a pod), then the pod's service account,
then a kubeconfig. The per-request timeout travels with the client so every helper uses the same one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import orjson
import structlog
import yaml
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import SERVICE_HOST_ENV_NAME, SERVICE_TOKEN_FILENAME
from urllib3.util.retry import Retry

from gputopo.kube.errors import KubeApiError, to_kube_error

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 10.0


class KubeConfigError(RuntimeError):
    """No usable Kubernetes credentials were found, or the ones found could not be loaded."""


class KubeApiClient(kubernetes.client.ApiClient):
    """An ApiClient that remembers the request timeout its helpers should use."""

    def __init__(self, configuration: kubernetes.client.Configuration, *, timeout_s: float) -> None:
        super().__init__(configuration)
        self.timeout_s = timeout_s


def request_timeout(api: kubernetes.client.ApiClient) -> float:
    """The per-request timeout of `api` (clients not made here get the default)."""
    value = getattr(api, "timeout_s", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_TIMEOUT_S


def _kubeconfig_paths() -> list[Path]:
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path("~/.kube/config").expanduser()]


def _in_cluster() -> bool:
    return bool(os.environ.get(SERVICE_HOST_ENV_NAME)) and Path(SERVICE_TOKEN_FILENAME).is_file()


def credentials_available() -> bool:
    """True when a service-account token or a kubeconfig file exists (decides the plugin's default --publish)."""
    return Path(SERVICE_TOKEN_FILENAME).is_file() or any(p.is_file() for p in _kubeconfig_paths())


def make_api_client(
    *,
    kubeconfig: str | None = None,
    host: str | None = None,
    token: str | None = None,
    verify_ssl: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> kubernetes.client.ApiClient:
    """An ApiClient for `host` (explicit), else in-cluster config, else the kubeconfig (given, KUBECONFIG or default).

    Raises KubeConfigError when nothing usable is found.
    """
    if timeout_s <= 0:
        raise KubeConfigError(f"timeout_s must be > 0, got {timeout_s}")
    cfg = kubernetes.client.Configuration()
    source = "explicit host"
    try:
        if host:
            cfg.host = host.rstrip("/")
        elif kubeconfig:
            source = f"kubeconfig {kubeconfig}"
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        elif _in_cluster():
            source = "in-cluster service account"
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        elif any(p.is_file() for p in _kubeconfig_paths()):
            # read KUBECONFIG now: the client's own default was frozen when it was imported
            files = os.pathsep.join(str(p) for p in _kubeconfig_paths() if p.is_file())
            source = f"kubeconfig {files}"
            kubernetes.config.load_kube_config(config_file=files, client_configuration=cfg)
        else:
            raise KubeConfigError(
                "no Kubernetes credentials: not in a pod (no service-account token) and no kubeconfig "
                f"({', '.join(str(p) for p in _kubeconfig_paths())})"
            )
    except (ConfigException, OSError, ValueError, yaml.YAMLError) as exc:
        raise KubeConfigError(f"cannot load Kubernetes configuration from {source}: {exc}") from exc
    if token:
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
    # Connection failures are retried (a pooled keep-alive socket may have gone stale); a read that timed out is
    # not, so timeout_s bounds a call instead of being multiplied by urllib3's silent retries.
    cfg.retries = Retry(total=3, connect=3, read=0, redirect=3, status=0, other=0)
    # An open watch holds its connection: the extender runs one per watched kind (nodes, pods, 4 group kinds, 10
    # job owner kinds) beside its calls; urllib3's default of 10 would open and discard one per call past it.
    cfg.connection_pool_maxsize = 32
    if host:
        cfg.verify_ssl = verify_ssl
    elif not verify_ssl:
        cfg.verify_ssl = False
    log.debug("kube.client.configured", source=source, host=cfg.host, timeout_s=timeout_s)
    return KubeApiClient(cfg, timeout_s=timeout_s)


def decode_json_response(resp: Any, *, operation: str) -> dict[str, Any]:
    """Read a raw urllib3 response fully, release its connection and decode it with orjson into a dict."""
    try:
        data = resp.data
    except Exception as exc:
        err = to_kube_error(exc, operation=operation)
        if err is None:
            raise
        raise err from exc
    finally:
        release = getattr(resp, "release_conn", None)
        if release is not None:
            release()
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise KubeApiError(
            int(getattr(resp, "status", 0) or 0),
            "MalformedResponse",
            f"reply is not JSON: {exc}; first bytes {bytes(data[:80])!r}",
            operation=operation,
        ) from exc
    if not isinstance(parsed, dict):
        raise KubeApiError(
            int(getattr(resp, "status", 0) or 0),
            "MalformedResponse",
            f"reply is JSON {type(parsed).__name__}, expected an object",
            operation=operation,
        )
    return parsed


def call_raw(operation: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a generated CoreV1Api method with _preload_content=False; raise typed errors instead of client ones."""
    try:
        return method(*args, _preload_content=False, **kwargs)
    except Exception as exc:
        err = to_kube_error(exc, operation=operation)
        if err is None:
            raise
        raise err from exc


def call_json(operation: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """call_raw, then decode the whole reply into a plain dict (no model classes: orders of magnitude faster)."""
    return decode_json_response(call_raw(operation, method, *args, **kwargs), operation=operation)

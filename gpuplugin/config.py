"""Settings of `gpuplugin run`: one pydantic model, filled from flags > environment > YAML file > defaults.

The precedence is resolved here rather than inside click so that every value remembers where it came from, and an
invalid one is reported with its field and its source ("metrics_port from GPUPLUGIN_METRICS_PORT: ..."): a
DaemonSet has three places a bad value can hide in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from gpuplugin.deviceplugin.allocation import ListStrategy
from gpuplugin.deviceplugin.devices import IdStrategy
from gpuplugin.deviceplugin.lifecycle import DEFAULT_RESOURCE_NAME, DEFAULT_SOCKET_NAME
from gputopo.contract import Keys, dns_subdomain_problem, extended_resource_problem, prefix_problem

ENV_PREFIX = "GPUPLUGIN_"
# Extra environment names a field also reads, after GPUPLUGIN_<FIELD> (NODE_NAME from the downward API).
EXTRA_ENV: dict[str, tuple[str, ...]] = {"node_name": ("NODE_NAME",)}
# Linux sun_path holds 108 bytes including the NUL.
MAX_SOCKET_PATH = 107


class ConfigError(ValueError):
    """An invalid setting. `field` is the setting's name, `source` where its value came from."""

    def __init__(self, message: str, field: str | None = None, source: str | None = None) -> None:
        self.field = field
        self.source = source
        super().__init__(message)


class PluginConfig(BaseModel):
    """Validated settings. Field names are the flag names with '_' for '-'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    resource_name: str = DEFAULT_RESOURCE_NAME
    topology: Path | None = None
    device_list_strategy: ListStrategy = ListStrategy.ENVVAR
    device_id_strategy: IdStrategy = IdStrategy.UUID
    node_name: str | None = None
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    metrics_port: int = 8080
    annotation_prefix: str = "gpu-topology.io"
    publish: bool | None = None  # None: on when Kubernetes credentials exist
    socket_name: str = DEFAULT_SOCKET_NAME
    dev_root: Path = Path("/")
    log_level: str = "info"
    # Health monitor settings; None leaves the monitor's own default (gpuplugin.health).
    ignored_xids: tuple[int, ...] | None = None
    health_probe_interval: float | None = None
    health_recovery: float | Literal["never"] | None = None

    @field_validator("resource_name")
    @classmethod
    def _resource_name(cls, v: str) -> str:
        problem = extended_resource_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("annotation_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        problem = prefix_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("topology")
    @classmethod
    def _topology(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"{str(v)!r} is not a readable file")
        return v

    @field_validator("metrics_port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"{v} is not a TCP port (0-65535; 0 turns the metrics server off)")
        return v

    @field_validator("socket_name")
    @classmethod
    def _socket_name(cls, v: str) -> str:
        if not v or "/" in v or v in (".", "..", "kubelet.sock"):
            raise ValueError(f"{v!r} must be a bare file name other than kubelet.sock")
        return v

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        problem = dns_subdomain_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        v = v.lower()
        if v not in ("debug", "info", "warning", "error"):
            raise ValueError(f"{v!r} is not one of debug, info, warning, error")
        return v

    @field_validator("publish", mode="before")
    @classmethod
    def _publish(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() == "auto" else v

    @field_validator("ignored_xids", mode="before")
    @classmethod
    def _xids(cls, v: Any) -> Any:
        if isinstance(v, str):
            parts = [p.strip() for p in v.split(",") if p.strip()]
            try:
                return tuple(int(p) for p in parts)
            except ValueError:
                raise ValueError(f"{v!r} is not a comma-separated list of Xid numbers") from None
        return v

    @field_validator("health_probe_interval")
    @classmethod
    def _probe_interval(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"{v} must be a positive number of seconds")
        return v

    @field_validator("health_recovery", mode="before")
    @classmethod
    def _recovery_never(cls, v: Any) -> Any:
        return "never" if isinstance(v, str) and v.strip().lower() == "never" else v

    @field_validator("health_recovery")
    @classmethod
    def _recovery(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and v < 0:
            raise ValueError(f"{v} must be >= 0 seconds, or 'never'")
        return v

    @property
    def keys(self) -> Keys:
        return Keys(self.annotation_prefix)

    @model_validator(mode="after")
    def _socket_path_length(self) -> PluginConfig:
        path = str(self.device_plugin_dir / self.socket_name)
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes (unix socket limit)")
        return self


FIELDS: tuple[str, ...] = tuple(PluginConfig.model_fields)


def env_names(field: str) -> tuple[str, ...]:
    return (ENV_PREFIX + field.upper(), *EXTRA_ENV.get(field, ()))


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML file's settings, keys normalised to field names. Unknown keys are errors (a typo would otherwise
    silently fall back to a default)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}", "config", str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}", "config", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            known = ", ".join(f.replace("_", "-") for f in FIELDS)
            raise ConfigError(
                f"config file {path}: unknown setting {key!r} (known: {known})",
                str(key),
                str(path),
            )
        out[name] = value
    return out


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str] | None = None, config_file: Path | None = None
) -> PluginConfig:
    """Settings from `flags` (None = not given), then `env`, then the YAML file, then defaults. Raises ConfigError
    naming the first invalid field and where its value came from."""
    env = os.environ if env is None else env
    file_values = read_config_file(config_file) if config_file is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for field in FIELDS:
        if flags.get(field) is not None:
            values[field], sources[field] = flags[field], f"--{field.replace('_', '-')}"
            continue
        name = next((n for n in env_names(field) if env.get(n) not in (None, "")), None)
        if name is not None:
            values[field], sources[field] = env[name], name
        elif field in file_values:
            values[field], sources[field] = file_values[field], f"config file {config_file}"
    unknown = set(flags) - set(FIELDS)
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    try:
        return PluginConfig(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None
        source = sources.get(field or "", "")
        value = values.get(field or "")
        where = f" from {source}" if source else ""
        got = f" (got {value!r})" if field in values else ""
        message = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"invalid {field or 'configuration'}{where}: {message}{got}", field, source) from None

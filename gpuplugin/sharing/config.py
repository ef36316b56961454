"""NVIDIA's device plugin config file (`version: v1`), read unchanged, and the per-node choice among named configs.

Teams migrating keep the file they have: the same keys (`sharing.timeSlicing` / `sharing.mps`, `renameByDefault`,
`failRequestsGreaterThanOne`, `resources[].name/replicas/rename/devices`), the same defaults and the same rules
(replicas >= 2, one strategy per node). Beyond NVIDIA, `rename` and `devices` are honoured (NVIDIA strips them at
load time), so one node can hold shared and whole GPUs and different replica counts per GPU (NVIDIA #1786).
The other members NVIDIA's file may carry (`flags`, `resources`, `imex`) are accepted and not applied: our
settings come from gputopo.settings, one loader; `flags` are logged once so nobody thinks they took effect. One flag
is applied: `flags.migStrategy` (none, single, mixed; checked here, so a bad value names its field), because a team
moving from NVIDIA's plugin has the node's MIG strategy in this file, chosen per node by the same label. Which wins:
the plugin's own `mig-strategy` setting when it is set (flag, environment or --config), else the chosen file's
`flags.migStrategy`, else none. The setting wins because it is the explicit choice for this DaemonSet (NVIDIA's
plugin also lets a command-line flag override the file); the file's value follows the node label, so a node
relabelled to another config changes strategy without a restart (gpuplugin.sharing.mig_node re-decides).

Per node the config is chosen as NVIDIA's config-manager chooses it: a directory of named files (a mounted
ConfigMap: one key per config), the node label `nvidia.com/device-plugin.config` naming one, else the default
(the `default` setting, else a config named `default`, else the only one). An unknown label value changes nothing.
Or, as NVIDIA's plugin takes it with `--config-file`, one file served whatever the label says.

Every error names the field (`sharing.timeSlicing.resources[1].replicas`), so a bad ConfigMap is fixed from the log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuplugin.sharing.mig_strategy import MigStrategy, MigStrategyError, strategy_from_flags
from gputopo.settings import ExtendedResourceName

DEFAULT_CONFIG_LABEL = "nvidia.com/device-plugin.config"
DEFAULT_CONFIG_NAME = "default"
SHARED_SUFFIX = ".shared"  # NVIDIA's DefaultSharedResourceNameSuffix
MAX_CONFIG_BYTES = 256 * 1024
MAX_CONFIGS = 256
MAX_REPLICAS = 1024  # gputopo.core.codec.MAX_REPLICAS: the state annotation refuses more


class SharingConfigError(ValueError):
    """A config file that cannot be served. `field` is the dotted path of the bad member ('' for the file)."""

    def __init__(self, message: str, field: str = "", source: str = "") -> None:
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        at = f"{field}: " if field else ""
        super().__init__(f"{where}{at}{message}")


# `devices`: "all", a count of GPUs (the first N by index), or GPU indices / UUIDs; in an entry named after a MIG
# resource, MIG UUIDs (gpuplugin.sharing.layout.share_mig).
DeviceRef = int | str
Devices = Literal["all"] | Annotated[int, Field(gt=0)] | list[DeviceRef]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ReplicatedResource(_Model):
    """One entry of `resources`: replicas of each GPU of `devices`, advertised as `rename` (or the default)."""

    name: ExtendedResourceName
    replicas: int
    rename: ExtendedResourceName | None = None
    devices: Devices = "all"

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v: int) -> int:
        if not 2 <= v <= MAX_REPLICAS:
            raise ValueError(f"replicas must be from 2 to {MAX_REPLICAS} (1 is not sharing: leave the GPU out), "
                             f"got {v}")
        return v

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("devices must not be an empty list (leave it out for all GPUs)")
        if isinstance(v, bool):
            raise ValueError("devices must be 'all', a count or a list of GPU indices or UUIDs")
        return v


class ReplicatedResources(_Model):
    """`sharing.timeSlicing` or `sharing.mps`. `distinctGpus` is ours (NVIDIA has no such key): false lets one
    request take several replicas of one GPU; by default a request of k replicas gets k distinct GPUs."""

    rename_by_default: bool = Field(False, alias="renameByDefault")
    fail_requests_greater_than_one: bool | None = Field(None, alias="failRequestsGreaterThanOne")
    distinct_gpus: bool = Field(True, alias="distinctGpus")
    resources: list[ReplicatedResource] = Field(min_length=1, max_length=64)


class SharingSection(_Model):
    time_slicing: ReplicatedResources | None = Field(None, alias="timeSlicing")
    mps: ReplicatedResources | None = None

    @model_validator(mode="after")
    def _one_strategy(self) -> SharingSection:
        if self.time_slicing is not None and self.mps is not None:
            raise ValueError("timeSlicing and mps are both set; a node shares its GPUs one way (NVIDIA's rule too)")
        return self


class DevicePluginFile(_Model):
    """The whole file. Only `sharing` is applied (see the module docstring)."""

    version: str = "v1"
    flags: dict[str, Any] = Field(default_factory=dict)
    resources: dict[str, Any] | None = None
    sharing: SharingSection | None = None
    imex: dict[str, Any] | None = None

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v in (None, ""):
            return "v1"  # NVIDIA defaults an empty version
        if v != "v1":
            raise ValueError(f"unknown config version {v!r}; only v1 exists")
        return v

    @field_validator("flags", mode="before")
    @classmethod
    def _flags(cls, v: Any) -> Any:
        return {} if v is None else v


@dataclass(frozen=True)
class SharingConfig:
    """What a file asks of sharing, in our terms: the strategy and its entries (None strategy: no sharing)."""

    strategy: str | None  # "time-slicing" | "mps" | None
    section: ReplicatedResources | None
    flags: dict[str, Any]

    @property
    def fail_requests_greater_than_one(self) -> bool:
        """NVIDIA's default: false for time-slicing; for MPS an omitted value is true (v0.20.0), explicit false kept."""
        if self.section is None:
            return False
        if self.section.fail_requests_greater_than_one is not None:
            return self.section.fail_requests_greater_than_one
        return self.strategy == "mps"

    @property
    def mig_strategy(self) -> MigStrategy | None:
        """`flags.migStrategy` (validated by parse_config), None when the file does not set it."""
        return strategy_from_flags(self.flags)


NO_SHARING = SharingConfig(None, None, {})


def _field_path(loc: tuple[Any, ...]) -> str:
    aliases = {"time_slicing": "timeSlicing", "rename_by_default": "renameByDefault",
               "fail_requests_greater_than_one": "failRequestsGreaterThanOne", "distinct_gpus": "distinctGpus"}
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part.startswith(("int", "str", "list[", "literal[", "function-")) or
                                        part in ("constrained-int",)):
            continue  # pydantic's union branch names: not a member of the file
        else:
            out += ("." if out else "") + aliases.get(str(part), str(part))
    return out


def parse_config(text: str | bytes, source: str = "") -> SharingConfig:
    """Validate one file's text. Raises SharingConfigError naming the field."""
    if len(text) > MAX_CONFIG_BYTES:
        raise SharingConfigError(f"larger than {MAX_CONFIG_BYTES} bytes", source=source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SharingConfigError(f"not valid YAML or JSON: {e}"[:500], source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SharingConfigError(f"must be a mapping, not {type(data).__name__}", source=source)
    try:
        model = DevicePluginFile.model_validate(data)
    except ValidationError as e:
        err = min(e.errors(), key=lambda x: len(x["loc"]))  # the outermost problem: union branches nest deeper
        message = str(err["msg"]).removeprefix("Value error, ")
        raise SharingConfigError(message[:500], _field_path(tuple(err["loc"])), source) from None
    try:
        strategy_from_flags(model.flags)
    except MigStrategyError as e:
        raise SharingConfigError(str(e).removeprefix("flags.migStrategy: "), "flags.migStrategy", source) from None
    sharing = model.sharing
    if sharing is None or (sharing.time_slicing is None and sharing.mps is None):
        return SharingConfig(None, None, model.flags)
    if sharing.mps is not None:
        return SharingConfig("mps", sharing.mps, model.flags)
    return SharingConfig("time-slicing", sharing.time_slicing, model.flags)


def read_config(path: Path) -> SharingConfig:
    source = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise SharingConfigError(f"cannot read: {e.strerror or e}", source=source) from None
    return parse_config(raw, source)


# -- choosing a config per node ---------------------------------------------------------------------------------


def config_names(directory: Path) -> list[str]:
    """The named configs of a mounted ConfigMap: its regular files, without the kubelet's `..data` machinery."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        raise SharingConfigError(f"cannot list configs: {e.strerror or e}", source=str(directory)) from None
    names = [e.name for e in entries if not e.name.startswith(".") and e.is_file()]
    return names[:MAX_CONFIGS]


@dataclass(frozen=True)
class Choice:
    """Which named config a node serves and why (for the log)."""

    name: str | None  # None: no config at all (no sharing)
    path: Path | None
    why: str


def choose_config(directory: Path | None, label: str | None, default: str | None) -> Choice:
    """The config the node label names, else the default. Raises SharingConfigError when the label names nothing
    known (the caller keeps serving what it serves: NVIDIA skips reconfiguration then) or no default can be told.

    `directory` may also be one config file (NVIDIA's single-file form, `--sharing-config-file`): it is the config,
    and the label has nothing to choose among. The settings tell the two apart at start; here a regular file is
    the config, so every reader of the source (whole GPUs, MIG-only nodes) serves the same one."""
    if directory is None:
        return Choice(None, None, "no sharing config directory")
    if directory.is_file():
        return Choice(directory.name, directory, "the config file")
    names = config_names(directory)
    if label:
        if label not in names:
            raise SharingConfigError(f"node label names config {label!r}, which is not among {names}",
                                     DEFAULT_CONFIG_LABEL, str(directory))
        return Choice(label, directory / label, "node label")
    if default:
        if default not in names:
            raise SharingConfigError(f"default config {default!r} is not among {names}", "default", str(directory))
        return Choice(default, directory / default, "default setting")
    if DEFAULT_CONFIG_NAME in names:
        return Choice(DEFAULT_CONFIG_NAME, directory / DEFAULT_CONFIG_NAME, "config named default")
    if len(names) == 1:
        return Choice(names[0], directory / names[0], "the only config")
    if not names:
        return Choice(None, None, "the config directory is empty")
    raise SharingConfigError(f"{len(names)} configs and no default: set the default or name one 'default'",
                             "default", str(directory))

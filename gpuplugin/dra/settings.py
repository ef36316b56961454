"""Settings of the DRA driver (`gpuplugin dra`): one pydantic model, loaded by gputopo.settings (flags > environment
`GPUPLUGIN_DRA_<FLAG>` > YAML `--config` file > the defaults below; `NODE_NAME`, from the downward API, also gives
the node name).

`gpuplugin slices`, the what-if companion, builds the same model from its own plain options, so both commands
share the defaults and the checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuplugin.dra.catalog import DEFAULT_MAX_DEVICES, DEFAULT_SET_SIZES, MAX_SET_SIZE
from gpuplugin.sharing.config import DEFAULT_CONFIG_LABEL
from gpuplugin.sharing.mps import DEFAULT_CONTROL, DEFAULT_MPS_ROOT
from gputopo.contract import DEFAULT_PREFIX, dns_subdomain_problem
from gputopo.settings import Cli, LogLevel, NodeName, Port, ReadableFile, SettingsLoader

ENV_PREFIX = "GPUPLUGIN_DRA"
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")


def parse_ints(text: str | None, what: str) -> list[int]:
    """`0,3,5` -> [0, 3, 5]; a clear ValueError naming `what` otherwise."""
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of integers") from None


class DraSettings(BaseModel):
    """Validated settings. Field names are the flag names with '_' for '-' (min_publish_interval_s: the flag says
    --min-publish-interval)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_name: NodeName = Field(
        None, description="This node's name (required): the pool name and spec.nodeName.")
    driver_name: str = Field(DEFAULT_PREFIX, description="DRA driver name (DNS subdomain), also the attribute "
                                                         "domain and the CDI vendor.")
    topology: ReadableFile | None = Field(
        None, description="Run on this topology file (nvidia-smi topo -m text, NVML recording, compact JSON) "
                          "instead of NVML.")
    registry_dir: Path = Field(Path("/var/lib/kubelet/plugins_registry"),
                               description="The kubelet's plugin registry (our registration socket).")
    plugin_dir: Path | None = Field(None, description="Our DRA socket and state [/var/lib/kubelet/plugins/<driver>].")
    cdi_dir: Path = Field(Path("/var/run/cdi"), description="Where CDI spec files for prepared claims go.")
    set_sizes: Annotated[tuple[int, ...], Cli(metavar="SIZE,...")] = Field(
        DEFAULT_SET_SIZES, description="Sizes of GPU-set devices (comma-separated).")
    max_devices: int = Field(DEFAULT_MAX_DEVICES, gt=0, description="Most devices per pool (the best sets per "
                                                                   "size beyond).")
    republish: bool = Field(True, description="Reorder the published devices after every allocation change "
                                              "(--no-republish: the empty node's order forever).")
    min_publish_interval_s: Annotated[float, Cli(flag="min-publish-interval")] = Field(
        0.2, ge=0, description="Seconds between two republishes at least.")
    reconcile_interval_s: Annotated[float, Cli(flag="reconcile-interval")] = Field(
        60.0, gt=0, le=3600, description="Seconds between two checks that the prepared claims' ResourceClaims still "
                                         "exist (also one at start): a claim deleted without an unprepare is "
                                         "released and its GPUs offered again.")
    health: bool = Field(True, description="Serve the dra-health v1alpha1 service fed by NVML Xid health.")
    nvidia_cdi: bool = Field(True, description="Also name NVIDIA's CDI devices (nvidia.com/gpu=<uuid>) per GPU.")
    sharing_config_dir: Path | None = Field(
        None, description="Directory of GPU sharing configs in NVIDIA's device plugin format (the device plugin's "
                          "ConfigMap); a GPU it shares is published as one device with a capacity. Unset: no "
                          "sharing.")
    sharing_config_default: str | None = Field(
        None, description="The config a node without the label gets [the one named default, else the only one].")
    sharing_config_label: str = Field(DEFAULT_CONFIG_LABEL, description="Node label naming this node's config "
                                                                        "(read at start).")
    consumable_capacity: bool = Field(
        True, description="Publish shared GPUs as multi-allocatable devices with a capacity (DRAConsumableCapacity, "
                          "beta in 1.36); --no-consumable-capacity publishes them whole. An apiserver that refuses "
                          "them makes the driver fall back to whole GPUs by itself.")
    mps_root: Path = Field(DEFAULT_MPS_ROOT, description="Host directory of the MPS pipe, log and shm directories.")
    mps_control: str = Field(DEFAULT_CONTROL, description="The MPS control program run per MPS-shared set.")
    mig: bool = Field(True, description="Publish the existing MIG instances of MIG-enabled GPUs as devices.")
    metrics_port: Port = Field(8080, description="Port of /metrics and /healthz; 0 turns them off.")
    log_level: LogLevel = Field("info", description="Least level logged.")

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, value: str) -> str:
        problem = dns_subdomain_problem(value)
        if problem or len(value) > 63:
            raise ValueError(problem or f"{value!r} is longer than 63 characters")
        return value

    @field_validator("set_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: Any) -> Any:
        return tuple(parse_ints(value, "set sizes")) if isinstance(value, str) else value

    @field_validator("set_sizes")
    @classmethod
    def _sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        bad = [s for s in value if not 2 <= s <= MAX_SET_SIZE]
        if bad:
            raise ValueError(f"set sizes must be within 2..{MAX_SET_SIZE}, got {bad}")
        return value

    @model_validator(mode="after")
    def _needs_node(self) -> DraSettings:
        if self.node_name is None:
            raise ValueError("node-name is required (--node-name, GPUPLUGIN_DRA_NODE_NAME or NODE_NAME): it names "
                             "the pool and its spec.nodeName")
        return self

    @property
    def node(self) -> str:
        """The node name (never None once validated)."""
        assert self.node_name is not None
        return self.node_name

    @property
    def state_dir(self) -> Path:
        return self.plugin_dir if self.plugin_dir is not None else DEFAULT_PLUGINS_DIR / self.driver_name

    @property
    def taint_key(self) -> str:
        return f"{self.driver_name}/unhealthy"


SETTINGS = SettingsLoader(DraSettings, ENV_PREFIX)

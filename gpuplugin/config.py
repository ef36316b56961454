"""Settings of `gpuplugin run`: one pydantic model, loaded by gputopo.settings (flags > environment `GPUPLUGIN_<FLAG>`
> YAML `--config` file > the defaults below; `NODE_NAME`, from the downward API, also gives the node name).

The model is the one description of each setting: the flag, its help, type and default in `--help`, and
`--print-config`, all come from the fields here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuplugin.deviceplugin.allocation import ListStrategy
from gpuplugin.deviceplugin.devices import IdStrategy
from gpuplugin.deviceplugin.lifecycle import DEFAULT_RESOURCE_NAME, DEFAULT_SOCKET_NAME
from gpuplugin.sharing.config import DEFAULT_CONFIG_LABEL
from gpuplugin.sharing.mig_strategy import MigStrategy
from gpuplugin.sharing.mps import DEFAULT_CONTROL, DEFAULT_MPS_ROOT
from gputopo.contract import CA_GPU_UTILIZATION_THRESHOLD, DEFAULT_PREFIX, Keys
from gputopo.settings import (
    AnnotationPrefix,
    Cli,
    ExtendedResourceName,
    LogLevel,
    NodeName,
    Port,
    ReadableFile,
    SettingsLoader,
)

# Linux sun_path holds 108 bytes including the NUL.
MAX_SOCKET_PATH = 107
# The health monitor's defaults (gpuplugin.health says why these Xids are the pod's fault, not the GPU's).
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
DEFAULT_PROBE_INTERVAL_S = 5.0
DEFAULT_RECOVERY_S = 60.0


class PluginConfig(BaseModel):
    """Validated settings. Field names are the flag names with '_' for '-'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_plugin_dir: Path = Field(Path("/var/lib/kubelet/device-plugins"),
                                    description="The kubelet's device plugin directory (its socket and ours).")
    resource_name: ExtendedResourceName = Field(
        DEFAULT_RESOURCE_NAME, description="Extended resource advertised to the kubelet.")
    topology: ReadableFile | None = Field(
        None, description="Run on this topology file (nvidia-smi topo -m text, NVML recording, compact JSON) "
                          "instead of NVML.")
    device_list_strategy: ListStrategy = Field(
        ListStrategy.ENVVAR,
        description="How the runtime learns the GPUs: envvar (NVIDIA_VISIBLE_DEVICES: the NVIDIA Container "
                    "Toolkit's runtime), cdi-cri (CDI names in the CRI field: kubelet 1.28+, containerd 1.7+ with CDI, "
                    "CRI-O 1.28+), cdi-annotations (CDI names in cdi.k8s.io/ annotations: runtimes that read those). "
                    "cdi is the deprecated name of cdi-cri.")
    device_id_strategy: IdStrategy = Field(IdStrategy.UUID, description="Device ids are GPU UUIDs or indices.")
    node_name: NodeName = Field(
        None, description="This node's name: publication and plans need it.")
    pod_resources_socket: Path = Field(Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
                                       description="The kubelet's PodResources socket (which GPUs are used).")
    pod_resources_poll_interval: float = Field(
        10.0, description="Seconds between reads of PodResources for the Node's published state (a GPU pod's end "
                          "is followed closely anyway); shorter publishes new allocations sooner, at one local call "
                          "per read and a Node patch only on a change.")
    metrics_port: Port = Field(8080, description="Port of /metrics and /healthz; 0 turns them off.")
    annotation_prefix: AnnotationPrefix = Field(
        DEFAULT_PREFIX, description="Prefix of every node and pod annotation and label.")
    publish: bool | Literal["auto"] = Field(
        "auto", description="Publish topology and state on the Node (auto: when Kubernetes credentials exist).")
    socket_name: str = Field(DEFAULT_SOCKET_NAME, description="Our socket's file name in the plugin directory.")
    dev_root: Path = Field(Path("/"), description="Where the host's /dev is visible, to find device nodes.")
    log_level: LogLevel = Field("info", description="Least level logged.")
    ignored_xids: Annotated[tuple[int, ...], Cli(metavar="XID,...")] = Field(
        tuple(sorted(DEFAULT_IGNORED_XIDS)), description="Xids that do not mark a GPU unhealthy (comma-separated).")
    health_probe_interval: float = Field(DEFAULT_PROBE_INTERVAL_S, description="Seconds between health probes "
                                                                                "of each GPU.")
    fail_on_init_error: bool = Field(
        True, description="Exit when NVML cannot be initialised (no driver in the pod); --no-fail-on-init-error stays "
                          "up advertising no GPUs, healthy, until restarted.")
    health_recovery: Annotated[float | Literal["never"], Cli(metavar="SECONDS|never")] = Field(
        DEFAULT_RECOVERY_S, description="Seconds of passing probes before an unhealthy GPU is healthy again, or never.")
    sharing_config_dir: Annotated[Path | None, Cli(metavar="DIRECTORY")] = Field(
        None, description="Directory of GPU sharing configs in NVIDIA's device plugin format (version: v1, "
                          "sharing.timeSlicing / sharing.mps), one file per name: a mounted ConfigMap, the node "
                          "label choosing among them. Exclusive with --sharing-config-file (both set: refused at "
                          "start). Unset, with no config file: no sharing.")
    sharing_config_file: Annotated[ReadableFile | None, Cli(env=("CONFIG_FILE",), aliases=("config-file",))] = Field(
        None, description="One GPU sharing config file in NVIDIA's device plugin format, served whatever the node "
                          "label says: NVIDIA's --config-file / CONFIG_FILE, so a node keeps the file it has. "
                          "Exclusive with --sharing-config-dir (both set: refused at start). Re-read every "
                          "--sharing-poll-interval.")
    sharing_config_default: str | None = Field(
        None, description="Config of --sharing-config-dir served when the node label names none (else one named "
                          "'default', else the only one).")
    sharing_config_label: str = Field(DEFAULT_CONFIG_LABEL, description="Node label naming this node's config.")
    sharing_poll_interval: float = Field(10.0, description="Seconds between re-reads of the sharing config and the "
                                                           "node label.")
    sharing_labels: bool | Literal["auto"] = Field(
        "auto", description="Write the GFD labels of the shared layout (nvidia.com/gpu.replicas, .sharing-strategy, "
                            ".product, nvidia.com/mps.capable) when sharing is configured. auto: only while the Node "
                            "carries no nvidia.com/gfd.timestamp (GPU Feature Discovery labels it), re-decided on "
                            "every publication; --sharing-labels always, --no-sharing-labels never.")
    mps_root: Path = Field(DEFAULT_MPS_ROOT, description="Host directory of the MPS pipe, log and shm directories "
                                                         "(a hostPath mounted at the same path).")
    mps_control: str = Field(DEFAULT_CONTROL, description="The MPS control program run per shared set.")
    mig_strategy: MigStrategy | None = Field(
        None, description="NVIDIA's migStrategy: none (MIG-enabled GPUs left out, the reason kept for the node), "
                          "single (every MIG device as the plugin's resource, on a uniformly partitioned node only), "
                          "mixed (nvidia.com/mig-<profile> per profile beside the whole GPUs). Unset: the sharing "
                          "config's flags.migStrategy, else none; set, it wins over the file.")
    mig_poll_interval: float = Field(10.0, description="Seconds between re-reads of the MIG layout through NVML "
                                                       "(instances created or destroyed are re-advertised).")
    nvml_recording: ReadableFile | None = Field(
        None, description="Answer NVML from this recording (gpuplugin record) instead of the driver: discovery, MIG "
                          "and health run as on the recorded node; the file is re-read when it changes. For tests "
                          "and demos.")
    mps_daemons: Literal["in-plugin", "external"] = Field(
        "in-plugin", description="Who runs the MPS control daemons: in-plugin (this process; a plugin container "
                                 "restart ends them) or external (the MPS control daemon set, `gpuplugin "
                                 "mps-control`, from the desired-state file this plugin writes on --mps-root).")
    mps_probe_interval: float = Field(5.0, description="Seconds between probes of each MPS control daemon (its "
                                                       "replicas are unhealthy while it does not answer).")
    autoscaler_busy_threshold: Annotated[float, Cli(metavar="SHARE")] = Field(
        CA_GPU_UTILIZATION_THRESHOLD,
        description="On a node with shared (time-slicing, MPS) or MIG GPUs, whose GPU request ratio the Cluster "
                    "Autoscaler misreads: while this share (0-1) of its physical GPUs or more is in use, annotate the "
                    "Node so neither the Cluster Autoscaler (scale-down-disabled) nor Karpenter (do-not-disrupt) "
                    "removes it; below it, remove what the plugin set (never an annotation set by someone else). "
                    "Needs publication. 0 turns it off.")

    @field_validator("socket_name")
    @classmethod
    def _socket_name(cls, v: str) -> str:
        if not v or "/" in v or v in (".", "..", "kubelet.sock"):
            raise ValueError(f"{v!r} must be a bare file name other than kubelet.sock")
        return v

    @field_validator("publish", "health_recovery", "sharing_labels", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

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

    @field_validator("mig_strategy", mode="before")
    @classmethod
    def _mig_strategy(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("health_probe_interval", "sharing_poll_interval", "mig_poll_interval", "mps_probe_interval",
                     "pod_resources_poll_interval")
    @classmethod
    def _probe_interval(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"{v} must be a positive number of seconds")
        return v

    @field_validator("autoscaler_busy_threshold")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{v} must be a share from 0 to 1 (0: off)")
        return v

    @field_validator("health_recovery")
    @classmethod
    def _recovery(cls, v: float | str) -> float | str:
        if isinstance(v, float) and not v >= 0:
            raise ValueError(f"{v} must be >= 0 seconds, or 'never'")
        return v

    @property
    def keys(self) -> Keys:
        return Keys(self.annotation_prefix)

    @property
    def health_recovery_s(self) -> float | None:
        """The health monitor's recovery time; None keeps an unhealthy GPU unhealthy."""
        return None if self.health_recovery == "never" else float(self.health_recovery)

    @model_validator(mode="after")
    def _one_source(self) -> PluginConfig:
        if self.topology is not None and self.nvml_recording is not None:
            raise ValueError("topology and nvml_recording both name the node's GPUs; give one")
        return self

    @field_validator("sharing_config_dir")
    @classmethod
    def _sharing_dir(cls, v: Path | None) -> Path | None:
        """A file here used to be served as "no configs" with a warning: whole GPUs a team thought shared. A
        directory that is missing is refused at start (gpuplugin.commands.run), not here: --print-config of a
        chart's arguments runs where the ConfigMap is not mounted."""
        if v is not None and v.exists() and not v.is_dir():
            raise ValueError(f"{str(v)!r} is a file, not a directory of named configs; NVIDIA's single config file "
                             "goes in --sharing-config-file (or CONFIG_FILE)")
        return v

    @model_validator(mode="after")
    def _one_sharing_source(self) -> PluginConfig:
        # Two sources would make the served config depend on a precedence nobody wrote down: refuse instead.
        if self.sharing_config_dir is not None and self.sharing_config_file is not None:
            raise ValueError("--sharing-config-dir and --sharing-config-file both name the sharing config; give one "
                             "(a directory of named configs chosen by the node label, or one config file)")
        if self.sharing_config_file is not None and self.sharing_config_default is not None:
            raise ValueError("--sharing-config-default picks among the configs of --sharing-config-dir; "
                             "--sharing-config-file is a single config, so leave the default unset")
        return self

    @property
    def sharing_source(self) -> Path | None:
        """Where sharing configs come from (a directory of named configs or one file), None without sharing."""
        return self.sharing_config_dir or self.sharing_config_file

    @model_validator(mode="after")
    def _socket_path_length(self) -> PluginConfig:
        path = str(self.device_plugin_dir / self.socket_name)
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes (unix socket limit)")
        return self


SETTINGS = SettingsLoader(PluginConfig, "GPUPLUGIN")

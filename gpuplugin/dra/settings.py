"""Settings of the DRA driver (`gpuplugin dra`) and of its what-if companion (`gpuplugin slices`).

Kept in this one pydantic model with plain click options in gpuplugin/commands/dra.py and slices.py, so they can
move to the project's generated options (gputopo/settings.py) as they are: one field, one flag, env
GPUPLUGIN_DRA_<FIELD>.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuplugin.dra.catalog import DEFAULT_MAX_DEVICES, DEFAULT_SET_SIZES, MAX_SET_SIZE
from gputopo.contract import DEFAULT_PREFIX, dns_subdomain_problem

ENV_PREFIX = "GPUPLUGIN_DRA_"


def parse_ints(text: str | None, what: str) -> list[int]:
    """`0,3,5` -> [0, 3, 5]; a clear ValueError naming `what` otherwise."""
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of integers") from None


class DraSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    driver_name: str = Field(DEFAULT_PREFIX, description="DRA driver name (DNS subdomain), also the attribute domain.")
    node_name: str = Field(..., min_length=1, description="This node's name: the pool name and spec.nodeName.")
    topology: Path | None = Field(None, description="Topology file instead of NVML discovery.")
    registry_dir: Path = Field(Path("/var/lib/kubelet/plugins_registry"), description="Kubelet plugin registry.")
    plugin_dir: Path | None = Field(None, description="Socket and state dir [/var/lib/kubelet/plugins/<driver>].")
    cdi_dir: Path = Field(Path("/var/run/cdi"), description="Where CDI spec files for prepared claims go.")
    set_sizes: tuple[int, ...] = Field(DEFAULT_SET_SIZES, description="Sizes of GPU-set devices.")
    max_devices: int = Field(DEFAULT_MAX_DEVICES, gt=0, description="Most devices per pool.")
    republish: bool = Field(True, description="Reorder the published devices after every allocation change.")
    min_publish_interval_s: float = Field(0.2, ge=0, description="Rate limit of republishes.")
    health: bool = Field(True, description="Serve the dra-health v1alpha1 service fed by NVML Xid health.")
    nvidia_cdi: bool = Field(True, description="Also name NVIDIA's CDI devices (nvidia.com/gpu=<uuid>) per GPU.")
    metrics_port: int = Field(8080, ge=0, le=65535, description="Port of /metrics and /healthz; 0 = off.")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, value: str) -> str:
        problem = dns_subdomain_problem(value)
        if problem or len(value) > 63:
            raise ValueError(problem or f"{value!r} is longer than 63 characters")
        return value

    @field_validator("set_sizes")
    @classmethod
    def _sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        bad = [s for s in value if not 2 <= s <= MAX_SET_SIZE]
        if bad:
            raise ValueError(f"set sizes must be within 2..{MAX_SET_SIZE}, got {bad}")
        return value

    @property
    def state_dir(self) -> Path:
        return self.plugin_dir if self.plugin_dir is not None else Path("/var/lib/kubelet/plugins") / self.driver_name

    @property
    def taint_key(self) -> str:
        return f"{self.driver_name}/unhealthy"

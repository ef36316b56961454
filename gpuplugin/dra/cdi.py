"""CDI spec files for prepared claims: one file per claim, one CDI device per DRA device, removed on unprepare.

The container runtime reads them when it creates a container whose CDIDevices name them (the kubelet copies our
cdi_device_ids into the CRI request). Each device brings its device nodes (a GPU's /dev/nvidia<minor>; a MIG
instance's parent node and capability nodes) and, for a GPU shared through MPS, the MPS environment and mounts;
the spec brings the control nodes and the claim's configured environment. Files are written atomically and named
after the claim, so leftovers of claims no longer prepared can be found and removed at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuplugin.deviceplugin.allocation import Mount
from gpuplugin.dra.errors import StateError

CDI_VERSION = "0.6.0"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass(frozen=True)
class DeviceEdits:
    """What one CDI device adds to the container."""

    nodes: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()

    def container_edits(self) -> dict:
        out: dict = {"deviceNodes": [{"path": p} for p in self.nodes]}
        if self.env:
            out["env"] = [f"{k}={v}" for k, v in sorted(self.env.items())]
        if self.mounts:
            out["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path,
                              "options": ["rbind", "ro" if m.read_only else "rw"]} for m in self.mounts]
        return out


class CdiWriter:
    def __init__(self, directory: Path, driver: str) -> None:
        self.directory = Path(directory)
        self.driver = driver
        self.kind = f"{driver}/gpu"
        self._prefix = f"{driver}-claim_"

    def device_id(self, claim_uid: str, device: str) -> str:
        return f"{self.kind}={claim_uid}-{device}"

    def path(self, claim_uid: str) -> Path:
        return self.directory / f"{self._prefix}{claim_uid}.json"

    def write(self, claim_uid: str, devices: Mapping[str, DeviceEdits], env: Mapping[str, str]) -> None:
        """`devices`: DRA device name -> its edits; `env` goes to every container that gets one of them."""
        spec = {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [
                {"name": f"{claim_uid}-{name}", "containerEdits": edits.container_edits()}
                for name, edits in devices.items()
            ],
            "containerEdits": {"deviceNodes": [{"path": p} for p in CONTROL_DEVICES],
                               "env": [f"{k}={v}" for k, v in sorted(env.items())]},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cdi-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f, indent=1)
            os.replace(tmp, self.path(claim_uid))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StateError(f"cannot write CDI spec {self.path(claim_uid)}: {e.strerror or e}") from None

    def remove(self, claim_uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(claim_uid).unlink()

    def claims_on_disk(self) -> set[str]:
        if not self.directory.is_dir():
            return set()
        return {p.name[len(self._prefix):-5] for p in self.directory.glob(f"{self._prefix}*.json")}

    def remove_all_but(self, keep: Iterable[str]) -> list[str]:
        """Remove spec files of claims not in `keep` (left by a crash between the two writes); return their UIDs."""
        stale = sorted(self.claims_on_disk() - set(keep))
        for uid in stale:
            self.remove(uid)
        return stale

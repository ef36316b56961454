"""The prepared claims, kept in one JSON file across restarts (the kubelet repeats prepares and unprepares after
its own restarts and expects the same answers; an unprepare may come after a driver restart).

Written atomically (temporary file, fsync, rename), so a crash leaves the old or the new state, never half of one.
A file that cannot be read stops the driver with an error naming it: starting empty would forget GPUs that running
containers hold. The shared-GPU fields of a device are optional on read, so files written before them still load.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuplugin.dra.errors import StateError

VERSION = 1
MAX_STATE_BYTES = 16 << 20


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    gpus: tuple[str, ...]  # GPU (or MIG instance) UUIDs, to notice a topology that changed under a held device
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None  # a shared GPU's allocation: the scheduler's shareID
    replicas: int = 0  # a shared GPU's allocation: the replicas and memory (MiB) it consumes
    memory_mib: int = 0


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...] = field(default_factory=tuple)


class StateFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, PreparedClaim]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StateError(f"cannot read DRA state {self.path}: {e.strerror or e}") from None
        try:
            if len(raw) > MAX_STATE_BYTES:
                raise ValueError(f"{len(raw)} bytes, more than {MAX_STATE_BYTES}")
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}, this driver reads {VERSION}")
            claims = {}
            for uid, c in data["claims"].items():
                devices = tuple(
                    PreparedDevice(tuple(d["request_names"]), d["pool"], d["device"], tuple(d["gpus"]),
                                   tuple(d["cdi_device_ids"]), d.get("share_id"), int(d.get("replicas", 0)),
                                   int(d.get("memory_mib", 0)))
                    for d in c["devices"]
                )
                claims[uid] = PreparedClaim(uid, c["namespace"], c["name"], devices)
            return claims
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(
                f"DRA state {self.path} is unreadable ({e}); it lists the claims prepared on this node: repair it, "
                "or move it aside to start with none (their GPUs are then offered again)"
            ) from None

    def save(self, claims: dict[str, PreparedClaim]) -> None:
        data = {"version": VERSION, "claims": {uid: asdict(c) for uid, c in sorted(claims.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StateError(f"cannot write DRA state {self.path}: {e.strerror or e}") from None

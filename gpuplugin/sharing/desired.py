"""The MPS sets a node wants, as a file on the MPS root: written by the plugin, read by `gpuplugin mps-control`.

With `--mps-daemons external` the control daemons live in a DaemonSet of their own (gpuplugin.sharing.keeper), so
a plugin pod restart or upgrade no longer ends them with the plugin's container. The plugin still decides what is
served, and when an MPS set may go (only once no pod holds its replicas); it says so here, and the keeper makes
the hostPath match. The file is state, not a message: it is replaced atomically (write a temporary file beside it,
fsync, rename), so a reader sees the old or the new whole file, never half of one, and a keeper that was down reads
what is wanted now.

`generation` per set: the plugin raises it when it replaced a set (its daemon must quit and start again, which
ends its clients' server: the plugin waited for them); the same generation with other GPUs or replicas only
changes the daemon's defaults (a restarted plugin whose config cut a GPU differently adopts the running daemon,
as in-plugin mode does). The file is outside input for the keeper (a hostPath others can write), so it is read
bounded and checked whole: a set's directories must be the ones its resource name gives under the keeper's own
root, and a bad file is refused whole (the keeper keeps the last good state).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuplugin.sharing.mps import MpsGpu, MpsShare
from gputopo.contract import extended_resource_problem

DESIRED_FILE = "mps-desired.json"  # under the MPS root; no resource directory can have this name (they hold a '/')
MAX_DESIRED_BYTES = 256 * 1024  # a node has a few sets of at most a few dozen GPUs: a few KiB
MAX_SETS = 64
MAX_GPUS = 256
VERSION = 1


class DesiredStateError(ValueError):
    """The desired-state file cannot be used; `path` names it."""

    def __init__(self, message: str, path: Path) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


class _Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
    replicas: Annotated[int, Field(ge=2, le=1024)]
    memory_mib: Annotated[int, Field(ge=1, le=1 << 30)] | None = None


class _Set(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    resource: Annotated[str, Field(max_length=253)]
    generation: Annotated[int, Field(ge=1)]
    pipe_dir: Annotated[str, Field(max_length=4096)]
    log_dir: Annotated[str, Field(max_length=4096)]
    several_per_client: bool = False
    gpus: Annotated[tuple[_Gpu, ...], Field(min_length=1, max_length=MAX_GPUS)]

    @field_validator("resource")
    @classmethod
    def _resource(cls, v: str) -> str:
        problem = extended_resource_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1]
    sets: Annotated[tuple[_Set, ...], Field(max_length=MAX_SETS)]

    @model_validator(mode="after")
    def _unique(self) -> _File:
        names = [s.resource for s in self.sets]
        if len(names) != len(set(names)):
            raise ValueError(f"a resource is listed twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        return self


@dataclass(frozen=True)
class DesiredSet:
    """One MPS set as wanted: the share (where its daemon lives, its GPUs) and the generation it belongs to."""

    share: MpsShare
    generation: int


def desired_path(root: Path) -> Path:
    return root / DESIRED_FILE


def encode(sets: list[DesiredSet]) -> str:
    return json.dumps({"version": VERSION, "sets": [
        {"resource": d.share.resource, "generation": d.generation, "pipe_dir": str(d.share.pipe_dir),
         "log_dir": str(d.share.log_dir), "several_per_client": d.share.several_per_client,
         "gpus": [{"uuid": g.uuid, "replicas": g.replicas, "memory_mib": g.memory_mib} for g in d.share.gpus]}
        for d in sets]}, indent=1, sort_keys=True) + "\n"


def write_desired(root: Path, sets: list[DesiredSet]) -> None:
    """Replace the file atomically (raises OSError)."""
    root.mkdir(parents=True, exist_ok=True)
    text = encode(sets)
    fd, tmp = tempfile.mkstemp(prefix=".mps-desired-", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, desired_path(root))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_desired(root: Path) -> str | None:
    """The file's text as it is (bounded), or None when it is missing, unreadable or too large."""
    try:
        with open(desired_path(root), "rb") as f:
            raw = f.read(MAX_DESIRED_BYTES + 1)
    except OSError:
        return None
    return raw.decode(errors="replace") if len(raw) <= MAX_DESIRED_BYTES else None


def read_desired(root: Path) -> dict[str, DesiredSet] | None:
    """The sets wanted, by resource; None when there is no file yet (the plugin has not written one: nothing is
    decided, so nothing is quit). Raises DesiredStateError naming what is wrong."""
    path = desired_path(root)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DESIRED_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DesiredStateError(f"cannot read: {e.strerror or e}", path) from None
    if len(raw) > MAX_DESIRED_BYTES:
        raise DesiredStateError(f"larger than {MAX_DESIRED_BYTES} bytes", path)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DesiredStateError(f"not JSON: {e}", path) from None
    try:
        parsed = _File.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(file)"
        raise DesiredStateError(f"{where}: {str(err['msg']).removeprefix('Value error, ')}", path) from None
    out: dict[str, DesiredSet] = {}
    for s in parsed.sets:
        share = MpsShare(s.resource, root, tuple(MpsGpu(g.uuid, g.replicas, g.memory_mib) for g in s.gpus),
                         several_per_client=s.several_per_client)
        if (s.pipe_dir, s.log_dir) != (str(share.pipe_dir), str(share.log_dir)):
            raise DesiredStateError(
                f"set {s.resource!r}: pipe_dir {s.pipe_dir!r} / log_dir {s.log_dir!r} are not {str(share.pipe_dir)!r}"
                f" / {str(share.log_dir)!r} (the plugin and the MPS control daemon set must share one MPS root)",
                path)
        out[s.resource] = DesiredSet(share=share, generation=s.generation)
    return out

"""`gpuplugin record [-o FILE]`: write what live NVML says about this machine as a recording.

The recording (format: gputopo.discovery.recording) replays anywhere through the same discovery code, so a machine
recorded once can be simulated, tested and benchmarked without its GPUs. A summary of the topology the recording
replays to goes to stderr, so the person recording sees at once whether the links came out right.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import re
import sys

import click

from gputopo.discovery.nvml_backend import LiveNvmlBackend, NvmlBackend, NvmlError, NvmlUnavailableError
from gputopo.discovery.nvml_mig import discover_mig
from gputopo.discovery.recording import (
    RecordingFormatError,
    discover_recording,
    dump_recording,
    record,
    replay_backend,
)
from gputopo.logs import configure_logging

EXIT_NO_NVML = 2


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mig_summary(rec: dict) -> str:
    """The MIG GPUs of a recording and their devices, for the person recording to check at a glance."""
    gpus = [(g["index"], g["uuid"]) for g in rec["gpus"] if isinstance(g.get("uuid"), str) and "mig" in g]
    lines = []
    for m in discover_mig(replay_backend(rec), gpus):
        names = ", ".join(d.name or "?" for d in m.devices) or "no MIG devices"
        pending = "" if not m.mode_change_pending else f" (mode change pending: {m.pending_mode})"
        lines.append(f"; MIG GPU {m.nvml_index}{pending}: {names}")
    return "".join(lines)


def _summary(rec: dict) -> str:
    try:
        found = discover_recording(rec)
    except RecordingFormatError as e:
        return f"recorded {len(rec['gpus'])} GPU(s), but they replay to no usable topology: {e}{_mig_summary(rec)}"
    topo = found.topology
    links = sorted({topo.link(i, j).label for i in range(topo.size) for j in range(i + 1, topo.size)})
    models = sorted({g.model or "?" for g in topo.gpus})
    excluded = "".join(f"; excluded NVML GPU {x.nvml_index} ({x.reason})" for x in found.excluded)
    return (
        f"recorded {topo.size} GPU(s) ({', '.join(models)}), fabric {topo.fabric}, links {', '.join(links) or '-'}, "
        f"PCIe Gen{topo.pcie_generation}, NUMA {[g.numa_node for g in topo.gpus]}{excluded}{_mig_summary(rec)}"
    )


def _not_json_hint(path: str, raw: bytes) -> str:
    """What to run instead when the file is not a recording at all."""
    text = raw.decode("utf-8", "replace")
    if not text.lstrip().startswith(("{", "[")) and re.search(r"^\s*GPU0\b", text, re.MULTILINE):
        return (f"{path} is `nvidia-smi topo -m` text, not an NVML recording: `gpuplugin topo {path}` shows its "
                f"topology, `gpuplugin run --topology {path}` serves it")
    return f"{path} is not an NVML recording (JSON written by `gpuplugin record`)"


def _replay(path: str) -> NvmlBackend:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise click.ClickException(f"cannot read recording {path}: {e.strerror or e}") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise click.ClickException(_not_json_hint(path, raw)) from None
    try:
        return replay_backend(data)
    except RecordingFormatError as e:
        raise click.ClickException(f"{path}: {e}") from None
    except ValueError as e:
        raise click.ClickException(f"cannot read recording {path}: {e}") from None


@click.command("record")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default="-",
    show_default=True,
    help="Where to write the recording JSON ('-' = stdout).",
)
@click.option(
    "--sysfs-root",
    type=click.Path(file_okay=False),
    default="/sys",
    show_default=True,
    help="Where the kernel's sysfs is mounted (NUMA fallback when NVML does not say).",
)
@click.option(
    "--replay",
    "replay_file",
    type=click.Path(exists=True, dir_okay=False, readable=True),
    help="Record from an existing recording (either format) instead of live NVML: converts the probe "
    "format to this one.",
)
def command(output: str, sysfs_root: str, replay_file: str | None) -> None:
    """Record this machine's GPUs and links from live NVML into the recording JSON format."""
    # stdout may carry the recording itself: logs (warnings and worse) go to stderr.
    configure_logging("warning", sys.stderr)
    backend: NvmlBackend
    if replay_file is not None:
        backend = _replay(replay_file)
    else:
        backend = LiveNvmlBackend(sysfs_root=sysfs_root)
    try:
        backend.init()
    except NvmlUnavailableError as e:
        click.echo(
            f"gpuplugin record: NVML is not available here ({e.name}: {e.message}). Run it on a GPU node with the "
            "NVIDIA driver loaded (in a container: with the NVIDIA runtime and all GPUs visible).",
            err=True,
        )
        sys.exit(EXIT_NO_NVML)
    try:
        meta = {
            "tool": "gpuplugin record" + (f" --replay {replay_file}" if replay_file else ""),
            "gpuplugin": _version("gpu-topology-scheduling"),
            "nvidia_ml_py": _version("nvidia-ml-py"),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        rec = record(backend, meta=meta)
    except NvmlError as e:
        click.echo(f"gpuplugin record: NVML cannot list the GPUs: {e}", err=True)
        sys.exit(EXIT_NO_NVML)
    finally:
        with contextlib.suppress(NvmlError):
            backend.shutdown()
    text = dump_recording(rec)
    if output == "-":
        click.echo(text, nl=False)
    else:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None
    click.echo(_summary(rec), err=True)

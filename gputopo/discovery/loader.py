"""Read a topology from a file or stdin in any form: compact JSON, NVML recording, or nvidia-smi text.

Users hand `--topology FILE` whatever they have, so the form is told by content, not by file name: a JSON
object whose "gpus" are objects is an NVML recording (checked first, so a versioned recording is never taken
for the compact form), a JSON object with a version "v" is the compact annotation form, anything else is
`nvidia-smi topo -m` text. Every failure is a TopologyParseError that names the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gputopo.core.codec import topology_from_dict
from gputopo.core.errors import TopologyParseError
from gputopo.core.topology import Topology
from gputopo.discovery.smi_text import parse_nvidia_smi_topo

# recording.RECORDING_FORMAT, spelled out so that telling the forms apart does not import NVML code.
RECORDING_FORMAT = "gpuplugin.nvml-recording"
# Far above any real topology (a 72-GPU matrix with NICs is ~100 KiB); stops a wrong path from filling memory.
MAX_TOPOLOGY_BYTES = 16 * 1024 * 1024


def load_topology_file(path: str | Path) -> Topology:
    """Load a topology file of any supported form. Raises TopologyParseError naming the path."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOPOLOGY_BYTES + 1)
    except OSError as e:
        raise TopologyParseError(f"cannot read file: {e.strerror or e}", source=source) from None
    if len(data) > MAX_TOPOLOGY_BYTES:
        raise TopologyParseError(f"file is larger than {MAX_TOPOLOGY_BYTES} bytes", source=source)
    return load_topology_bytes(data, source)


def load_topology_bytes(data: bytes, source: str = "") -> Topology:
    """Decode (UTF-8, BOM allowed) and load; NUL bytes or invalid UTF-8 mean a binary file, not a topology."""
    if b"\x00" in data:
        raise TopologyParseError("binary content (NUL bytes), not a topology", source=source)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TopologyParseError(f"not UTF-8 text (byte {e.start})", source=source) from None
    return load_topology_text(text, source)


def load_topology_text(text: str, source: str = "") -> Topology:
    """Load a topology from text already read (stdin, an annotation, a test)."""
    if not text.strip():
        raise TopologyParseError("empty input", source=source)
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
            raise TopologyParseError(f"invalid JSON: {e}", source=source) from None
        return _load_json(data, source)
    return parse_nvidia_smi_topo(text, source=source)


def _load_json(data: Any, source: str) -> Topology:
    if not isinstance(data, dict):
        raise TopologyParseError("JSON topology must be an object", source=source)
    if _looks_like_recording(data):
        try:
            from gputopo.discovery.recording import load_recording_dict
        except ImportError as e:
            raise TopologyParseError(
                f"this looks like an NVML recording, but recording support is unavailable: {e}", source=source
            ) from None
        try:
            return load_recording_dict(data)
        except TopologyParseError as e:
            raise _with_source(e, source) from None
    if "v" in data:
        try:
            return topology_from_dict(data)
        except TopologyParseError as e:
            raise _with_source(e, source) from None
    raise TopologyParseError(
        "JSON is neither a compact topology (no 'v' key) nor an NVML recording (no 'gpus' objects)",
        source=source,
    )


def _looks_like_recording(data: dict[str, Any]) -> bool:
    """Recordings say so in "format", or (the probe format) list GPUs as objects; the compact form lists them as
    arrays."""
    if data.get("format") == RECORDING_FORMAT:
        return True
    gpus = data.get("gpus")
    return isinstance(gpus, list) and bool(gpus) and all(isinstance(g, dict) for g in gpus)


def _with_source(e: TopologyParseError, source: str) -> TopologyParseError:
    """The same error, of the same type, now naming the file it came from."""
    if not source or e.source:
        return e
    named = type(e)(str(e), source=source)
    named.row, named.column = e.row, e.column
    return named

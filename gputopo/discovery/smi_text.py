"""Build a Topology from the text of `nvidia-smi topo -m`, as users paste it.

The text is a square matrix over GPUs and NICs followed by affinity columns, separated by tabs, spaces or a
mix of both (posts and terminals rewrite them). Columns are found by their known names, cells by whitespace.
Any cell that cannot be read, any missing row and any asymmetric pair is a `TopologyParseError` naming the row
and column: a topology made up to fill a gap would place pods on links that do not exist.

What text cannot say, and how it is settled here (pass `nvlink_generation` / `gpu_model` to override):
- Direct NVLinks and an NVSwitch fabric both print as `NV#`. A GPU whose NVLink lanes to all peers add up to
  more than one GPU of that generation has (`bandwidth.NVLINK_LINKS_PER_GPU`) must reach them through a
  switch. Two switch-attached GPUs alone (the 2x H200 recording: NV18 to one peer) look exactly like a direct
  pair and are read as NVLINK; NVML discovery tells them apart, text cannot. The bandwidth estimate is the
  same either way.
- The NVLink generation is inferred from lane counts (`infer_nvlink_generation`); B200 prints NV18 like H100
  and A800 prints NV8 like H800, so those read as NVLink 4 unless the model is given.
- NICs are the RDMA devices NVML enumerates (their legend names are verbs devices, mlx5_N; a SoftiWARP device
  shows up there too, NVIDIA/NVSentinel#1485), so they are marked RDMA; their line rate is not in the text (None).
- GPU ids are "GPU0".."GPUn" (text has no UUIDs). A NUMA affinity such as "0-1" (a cpuset spanning nodes)
  gives numa_node None rather than picking one of them. Without any NUMA column, distinct CPU affinity groups
  stand for NUMA nodes (`_numa_from_cpu_affinity`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gputopo.core import bandwidth
from gputopo.core.errors import TopologyError, TopologyParseError
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology

CPU_AFFINITY = "CPU Affinity"
NUMA_AFFINITY = "NUMA Affinity"
GPU_NUMA_ID = "GPU NUMA ID"
AFFINITY_COLUMNS = (CPU_AFFINITY, NUMA_AFFINITY, GPU_NUMA_ID)

_AFFINITY_RE = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID")
_GPU_RE = re.compile(r"GPU[0-9]+")
_NIC_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.:\-]*")
_NV_RE = re.compile(r"NV([0-9]+)")
_LEGEND_START_RE = re.compile(r"^\s*(NIC\s+)?Legend\s*:", re.IGNORECASE)
_NIC_LEGEND_RE = re.compile(r"^\s*(NIC[0-9]+)\s*:\s*(\S+)\s*$")
_INT_RE = re.compile(r"[0-9]{1,9}")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# SOC is what drivers before ~2017 printed for SYS.
_PCIE_TOKENS: dict[str, LinkKind] = {
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,
}
_SELF = "X"
_EMPTY_VALUES = ("", "N/A")
_RESERVED_NAMES = frozenset({"CPU", "NUMA", "GPU", "Affinity", "ID", _SELF, *_PCIE_TOKENS})
_MAX_LANES = max(bandwidth.NVLINK_LINKS_PER_GPU.values())


@dataclass(frozen=True)
class _Header:
    gpus: list[str]
    nics: list[str]
    affinity: list[str]

    @property
    def devices(self) -> list[str]:
        return self.gpus + self.nics


@dataclass(frozen=True)
class _Row:
    name: str
    cells: list[str]  # link cells, one per device column, canonical tokens (X, NV#, PIX..SYS)
    affinity: dict[str, str]  # affinity column -> value as written ("" when empty)


def parse_nvidia_smi_topo(
    text: str,
    *,
    source: str = "",
    pcie_generation: int | None = None,
    nvlink_generation: int | None = None,
    gpu_model: str | None = None,
) -> Topology:
    """Parse `nvidia-smi topo -m` output; TopologyParseError (with `row`/`column`) on anything unreadable."""
    if nvlink_generation is not None and nvlink_generation not in bandwidth.NVLINK_GENERATIONS:
        raise TopologyParseError(f"unknown NVLink generation {nvlink_generation!r}", source=source)
    if pcie_generation is not None and pcie_generation not in bandwidth.PCIE_X16_GBPS:
        raise TopologyParseError(f"unknown PCIe generation {pcie_generation!r}", source=source)
    # nvidia-smi underlines the header with ANSI escapes even into a file (seen on driver 580): drop them.
    text = _ANSI_RE.sub("", text)
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = _find_header(lines, source)
    header = _parse_header(lines[start], source)
    rows, end = _read_rows(lines, start + 1, header, source)
    legend = _nic_legend(lines[end:], header, source)
    tokens = _check_symmetry(rows, header, source)

    n = len(header.gpus)
    lanes = [[_lanes(tokens[i][j]) if i != j else 0 for j in range(n)] for i in range(n)]
    gen = nvlink_generation or bandwidth.nvlink_generation_for_model(gpu_model)
    has_nvlink = any(any(row) for row in lanes)
    if has_nvlink and gen is None:
        gen = _infer_from_lanes(lanes)
    switched = [gen is not None and sum(lanes[i]) > bandwidth.NVLINK_LINKS_PER_GPU[gen] for i in range(n)]

    links: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if lanes[i][j]:
                kind = LinkKind.NVSWITCH if switched[i] or switched[j] else LinkKind.NVLINK
                links[i][j] = Link(kind, lanes[i][j], gen)
            else:
                links[i][j] = Link(_PCIE_TOKENS[tokens[i][j]])

    gpus = _numa_from_cpu_affinity([_gpu(i, rows[i], gpu_model) for i in range(n)])
    nics = [
        Nic(legend.get(name, name), tuple(_PCIE_TOKENS[tokens[n + k][j]] for j in range(n)), rdma=True)
        for k, name in enumerate(header.nics)
    ]
    if pcie_generation is None:
        pcie_generation = (
            bandwidth.PCIE_GENERATION_FOR_NVLINK[gen]
            if has_nvlink and gen is not None
            else bandwidth.DEFAULT_PCIE_GENERATION
        )
    try:
        return Topology.build(gpus, links, nics, pcie_generation=pcie_generation)
    except TopologyError as e:
        raise TopologyParseError(str(e), source=source) from None


def infer_nvlink_generation(links_per_gpu: int, peers: int) -> int:
    """NVLink generation from the NVLinks one GPU has in all, when neither caller nor model name says.

    Text carries only lane counts, and each generation's flagship part has a distinct total: P100 4, V100 6,
    A100 12, H100 18 (`bandwidth.NVLINK_LINKS_PER_GPU`). Known parts with fewer links are the exceptions:
    4 links to a single peer is an NVLink bridge pair of the A6000/A40 class (NVLink 3), while 4 spread over
    several peers is P100; 8 is the export-limited H800 (NVLink 4; an A800 also shows NV8 and is NVLink 3,
    which text cannot tell). Any other count takes the generation whose flagship total is the nearest at or
    above it (a GPU cannot have more links than its generation offers), the older one on a tie: so 18 reads as
    NVLink 4, although B200 (NVLink 5) prints NV18 too. Above every known total, the one with the most links.
    """
    if links_per_gpu == 4:
        return 3 if peers == 1 else 1
    if links_per_gpu == 8:
        return 4
    fitting = [(count, gen) for gen, count in bandwidth.NVLINK_LINKS_PER_GPU.items() if count >= links_per_gpu]
    if fitting:
        return min(fitting)[1]
    most = max(bandwidth.NVLINK_LINKS_PER_GPU.values())
    return min(gen for gen, count in bandwidth.NVLINK_LINKS_PER_GPU.items() if count == most)


def _infer_from_lanes(lanes: list[list[int]]) -> int:
    """Per-GPU link total: the lane sum for direct links, the pair count for a GPU proven switch-attached
    (its sum exceeds what any generation has). The GPU with the largest total speaks for the node."""
    best_total, best_peers = 0, 0
    for row in lanes:
        if not any(row):
            continue
        total = max(row) if sum(row) > _MAX_LANES else sum(row)
        peers = sum(1 for x in row if x)
        if (total, peers) > (best_total, best_peers):
            best_total, best_peers = total, peers
    return infer_nvlink_generation(best_total, best_peers)


def _find_header(lines: list[str], source: str) -> int:
    """The header is the first line that starts with GPU0 and has no X cell; lines before it (a shell
    prompt, a title) are not part of the matrix."""
    for i, line in enumerate(lines):
        words = line.split()
        if words and words[0] == "GPU0" and _SELF not in words:
            return i
    raise TopologyParseError("no header line (one that starts with GPU0) found", source=source, row="header")


def _header_names(line: str) -> list[str]:
    names: list[str] = []
    pos = 0
    for m in _AFFINITY_RE.finditer(line):
        names.extend(line[pos : m.start()].split())
        names.append(" ".join(m.group().split()))
        pos = m.end()
    names.extend(line[pos:].split())
    return names


def _parse_header(line: str, source: str) -> _Header:
    gpus: list[str] = []
    nics: list[str] = []
    affinity: list[str] = []
    for name in _header_names(line):

        def fail(message: str, name: str = name) -> TopologyParseError:
            return TopologyParseError(message, source=source, row="header", column=_show(name))

        if name in AFFINITY_COLUMNS:
            if name in affinity:
                raise fail("column appears twice")
            affinity.append(name)
        elif affinity:
            raise fail("unknown column after the affinity columns")
        elif _GPU_RE.fullmatch(name):
            if nics:
                raise fail("GPU column after NIC columns")
            if name != f"GPU{len(gpus)}":
                raise fail(f"expected column GPU{len(gpus)}")
            gpus.append(name)
        elif _NIC_NAME_RE.fullmatch(name) and name not in _RESERVED_NAMES and not _NV_RE.fullmatch(name):
            if name in nics:
                raise fail("column appears twice")
            nics.append(name)
        else:
            raise fail("unknown column name")
    return _Header(gpus, nics, affinity)


def _read_rows(lines: list[str], start: int, header: _Header, source: str) -> tuple[list[_Row], int]:
    """One row per device column, in header order, up to the first blank or legend line."""
    expected = header.devices
    rows: list[_Row] = []
    end = len(lines)
    for k in range(start, len(lines)):
        line = lines[k]
        if not line.strip() or _LEGEND_START_RE.match(line):
            end = k
            break
        words = line.split()
        name = words[0]
        if len(rows) == len(expected):
            raise TopologyParseError("row beyond the last header column", source=source, row=_show(name))
        want = expected[len(rows)]
        if name != want:
            raise TopologyParseError(
                f"missing row {want} (found {_show(name)!r} in its place)", source=source, row=want
            )
        rows.append(_row(line, words, len(rows), header, source))
    if len(rows) < len(expected):
        missing = expected[len(rows)]
        after = f"after row {rows[-1].name}" if rows else "before any row"
        raise TopologyParseError(f"missing row {missing}: the matrix ends {after}", source=source, row=missing)
    return rows, end


def _row(line: str, words: list[str], index: int, header: _Header, source: str) -> _Row:
    """Cells are checked left to right, so a short row fails at its first unreadable cell, not at the
    affinity count."""
    name, cells = words[0], words[1:]
    devices = header.devices
    links = [
        _token(raw, index, j, len(header.gpus), name, devices[j], source) for j, raw in enumerate(cells[: len(devices)])
    ]
    if len(cells) < len(devices):
        raise TopologyParseError(
            f"row ends after {len(cells)} of {len(devices)} link cells",
            source=source,
            row=name,
            column=devices[len(cells)],
        )
    rest = cells[len(devices) :]
    is_gpu = name in header.gpus
    if len(rest) > len(header.affinity):
        last = header.affinity[-1] if header.affinity else devices[-1]
        raise TopologyParseError(
            f"{len(rest)} cells after the link cells, for {len(header.affinity)} affinity columns",
            source=source,
            row=name,
            column=last,
        )
    if not is_gpu:
        return _Row(name, links, {})  # NICs print no affinity; any value there is not ours to keep
    if len(rest) < len(header.affinity):
        by_tabs = _affinity_by_tabs(line, name, cells[: len(devices)], header)
        if by_tabs is None:
            raise TopologyParseError(
                f"{len(rest)} of {len(header.affinity)} affinity cells; separators don't show which is empty",
                source=source,
                row=name,
                column=header.affinity[len(rest)],
            )
        rest = by_tabs
    return _Row(name, links, dict(zip(header.affinity, rest, strict=True)))


def _affinity_by_tabs(line: str, name: str, links: list[str], header: _Header) -> list[str] | None:
    """Tab-separated rows keep an empty cell as an empty field: use them only when the fields line up."""
    if "\t" not in line:
        return None
    parts = [p.strip() for p in line.split("\t")]
    if parts[0] != name or parts[1 : 1 + len(links)] != links:
        return None
    rest = parts[1 + len(links) :]
    if len(rest) != len(header.affinity) or rest[-1] == "":
        return None  # an empty last field is what a cut-off line looks like too
    return rest


def _nic_legend(lines: list[str], header: _Header, source: str) -> dict[str, str]:
    """NICn -> device name from the `NIC Legend:` block, for the NICn columns of the header."""
    legend: dict[str, str] = {}
    for line in lines:
        m = _NIC_LEGEND_RE.match(line)
        if not m or m.group(1) not in header.nics:
            continue
        key, value = m.group(1), m.group(2)
        if legend.get(key, value) != value:
            raise TopologyParseError(
                f"NIC legend names {key} twice ({legend[key]!r}, {value!r})",
                source=source,
                row="NIC Legend",
                column=key,
            )
        legend[key] = value
    return legend


def _check_symmetry(rows: list[_Row], header: _Header, source: str) -> list[list[str]]:
    """The square matrix of canonical tokens, after checking every cell against its mirror."""
    devices = header.devices
    tokens = [row.cells for row in rows]
    for i in range(len(devices)):
        for j in range(i + 1, len(devices)):
            if tokens[i][j] != tokens[j][i]:
                raise TopologyParseError(
                    f"{tokens[i][j]} here but {tokens[j][i]} in row {devices[j]} column {devices[i]}",
                    source=source,
                    row=devices[i],
                    column=devices[j],
                )
    return tokens


def _token(raw: str, i: int, j: int, n_gpus: int, row: str, column: str, source: str) -> str:
    def fail(message: str) -> TopologyParseError:
        return TopologyParseError(message, source=source, row=row, column=column)

    if i == j:
        if raw != _SELF:
            raise fail(f"diagonal cell must be X, found {_show(raw)!r}")
        return raw
    if raw == _SELF:
        raise fail("X off the diagonal")
    if raw in _PCIE_TOKENS:
        return _PCIE_TOKENS[raw].value
    m = _NV_RE.fullmatch(raw)
    if not m:
        raise fail(f"unknown link token {_show(raw)!r}")
    if i >= n_gpus or j >= n_gpus:
        raise fail(f"NVLink {raw} to a NIC")
    lanes = int(m.group(1)) if len(m.group(1)) <= 3 else 0
    if not 1 <= lanes <= _MAX_LANES:
        raise fail(f"{_show(raw)}: an NVLink bond has 1 to {_MAX_LANES} links")
    return f"NV{lanes}"


def _show(text: str) -> str:
    """Input quoted in a message, cut short: an error names the problem, it does not echo a megabyte."""
    return text if len(text) <= 24 else text[:21] + "..."


def _lanes(token: str) -> int:
    m = _NV_RE.fullmatch(token)
    return int(m.group(1)) if m else 0


def _numa_from_cpu_affinity(gpus: list[Gpu]) -> list[Gpu]:
    """Old drivers print no NUMA column (DGX-1 outputs). When no GPU has a NUMA id but the CPU affinity splits the
    GPUs into disjoint groups, each group is one socket's NUMA node, numbered in order of appearance. One shared
    affinity (or a quirky copy of it on every row) tells nothing and leaves NUMA unknown."""
    if any(g.numa_node is not None for g in gpus):
        return gpus
    groups: dict[str, int] = {}
    for g in gpus:
        if g.cpu_affinity is None:
            return gpus
        groups.setdefault(g.cpu_affinity, len(groups))
    if len(groups) < 2:
        return gpus
    return [replace(g, numa_node=groups[g.cpu_affinity or ""]) for g in gpus]


def _gpu(index: int, row: _Row, model: str | None) -> Gpu:
    numa = None
    for column in (NUMA_AFFINITY, GPU_NUMA_ID):
        value = row.affinity.get(column, "")
        if _INT_RE.fullmatch(value):
            numa = int(value)
            break
    cpu = row.affinity.get(CPU_AFFINITY, "")
    return Gpu(
        index=index,
        id=f"GPU{index}",
        model=model,
        numa_node=numa,
        cpu_affinity=None if cpu in _EMPTY_VALUES else cpu,
    )

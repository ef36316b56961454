"""Compact, versioned JSON for a topology and for a node's GPU state: the Node annotations of the contract.

Topology (version 1), keys kept short so a 16-GPU node with NICs fits in 4 KiB:
    {"v": 1,
     "gpus": [[id, pci_bus_id|null, numa|null, model_ref|null, memory_mib|null, cpu_affinity|null], ...],
     "models": [model name, ...],                       # model_ref indexes this list
     "links": ["SW12@3", "NV2@2", "PIX", ...],          # upper triangle, row-major: (0,1), (0,2), ..., (n-2,n-1)
     "bw": [300000, ...],                               # MB/s per direction, same order (informational)
     "nics": [[name, "IIHS..."], ...],                  # one letter per GPU: PIX I, PXB B, PHB H, NODE N, SYS S
     "nicattr": [[rdma 1|0|null, link Gb/s|null], ...], # same order as "nics"; only when some NIC has one
     "pcie": 4, "sock": 16.0}
GPU index = position in "gpus". The reader rebuilds bandwidths from "links" so every reader scores identically.

"nicattr" was added inside version 1 rather than as version 2: readers built before it ignore unknown keys and
keep reading the NIC rows they know (a version bump would make them refuse every node during a rolling upgrade,
plugins and extender being upgraded separately), and this reader takes a document without it as "unknown".

State (version 1): {"v": 1, "gen": int, "used": [ids], "unhealthy": [ids], "sharing": {...}}
"used" lists GPUs held whole. "sharing" is present only on a node that shares GPUs (time-slicing or MPS, issue 22):
    {"strategy": "time-slicing" | "mps", "failRequestsGreaterThanOne": bool,
     "resources": [{"name": resource, "gpus": [[gpu id, replicas, replicas used], ...]}, ...]}
A GPU listed under a shared resource is advertised only as replicas (`<gpu id>::<n>`), never whole, and never appears
in "used". It was added inside version 1, like "nicattr": readers built before it ignore it.
"mig" is present only on a node with MIG-enabled GPUs (issue 23), versioned on its own ("v"), so its shape can
change without failing every reader of the whole state during a rolling upgrade:
    {"v": 1, "strategy": "none" | "single" | "mixed", "reason": text | null,
     "gpus": [{"gpu": GPU UUID, "index": NVML index, "numa": int | null, "island": int | null,
               "model": name | null, "peers": [GPU ids],
               "instances": [[device name, start, size, MIG UUID, resource | null, used 0|1], ...]}, ...]}
"peers" (optional, only when "island" is set): the other GPUs of its NVLink island, by their ids in the topology
(whole GPUs) or their UUIDs (MIG GPUs), so a reader can tell the island in use when a whole GPU of it is held.
A MIG GPU is never offered whole and never appears in "used" (its instances' "used" says what pods hold); under
"none" its instances are listed with resource null (not advertised) and "reason" says why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gputopo.core.errors import TopologyError, TopologyFormatError
from gputopo.core.mig import MEMORY_SLICES, MigError, Placement, ProfileName, parse_profile_name
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology

TOPOLOGY_VERSION = 1
STATE_VERSION = 1
MAX_NICS = 256
_LINK_RE = re.compile(r"^(NV|SW)(\d{1,3})@(\d)$")
_NIC_LETTER = {LinkKind.PIX: "I", LinkKind.PXB: "B", LinkKind.PHB: "H", LinkKind.NODE: "N", LinkKind.SYS: "S"}
_NIC_KIND = {v: k for k, v in _NIC_LETTER.items()}


def link_to_token(link: Link) -> str:
    if link.kind is LinkKind.NVLINK:
        return f"NV{link.lanes}@{link.generation}"
    if link.kind is LinkKind.NVSWITCH:
        return f"SW{link.lanes}@{link.generation}"
    return link.kind.value


def link_from_token(token: str) -> Link:
    m = _LINK_RE.match(token)
    if m:
        kind = LinkKind.NVLINK if m.group(1) == "NV" else LinkKind.NVSWITCH
        return Link(kind, int(m.group(2)), int(m.group(3)))
    try:
        kind = LinkKind(token)
    except ValueError:
        raise TopologyFormatError(f"unknown link token {token!r}") from None
    if kind.is_nvlink:
        raise TopologyFormatError(f"link token {token!r} lacks lanes and generation")
    return Link(kind)


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    models: list[str] = []
    gpus = []
    for g in topo.gpus:
        ref = None
        if g.model is not None:
            if g.model not in models:
                models.append(g.model)
            ref = models.index(g.model)
        gpus.append([g.id, g.pci_bus_id, g.numa_node, ref, g.memory_mib, g.cpu_affinity])
    n = topo.size
    links, bw = [], []
    for i in range(n):
        for j in range(i + 1, n):
            links.append(link_to_token(topo.link(i, j)))
            bw.append(topo.bandwidth_mbps[i][j])
    out: dict[str, Any] = {"v": TOPOLOGY_VERSION, "gpus": gpus, "models": models, "links": links, "bw": bw}
    if topo.nics:
        out["nics"] = [[nic.name, "".join(_NIC_LETTER[k] for k in nic.gpu_links)] for nic in topo.nics]
        if any(nic.rdma is not None or nic.link_gbit is not None for nic in topo.nics):
            out["nicattr"] = [[_flag(nic.rdma), nic.link_gbit] for nic in topo.nics]
    out["pcie"] = topo.pcie_generation
    out["sock"] = topo.socket_link_gbps
    return out


def topology_to_json(topo: Topology) -> str:
    return json.dumps(topology_to_dict(topo), separators=(",", ":"))


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise TopologyFormatError(message)


def _opt(value: Any, typ: type, what: str) -> Any:
    ok = value is None or (isinstance(value, typ) and not isinstance(value, bool))
    _expect(ok, f"{what} must be {typ.__name__} or null")
    return value


def topology_from_dict(data: Any) -> Topology:
    _expect(isinstance(data, dict), "topology JSON must be an object")
    version = data.get("v")
    _expect(isinstance(version, int) and not isinstance(version, bool), "topology JSON has no integer version 'v'")
    if version > TOPOLOGY_VERSION:
        raise TopologyFormatError(
            f"topology JSON version {version} is newer than this build reads ({TOPOLOGY_VERSION}); upgrade the reader"
        )
    _expect(version == TOPOLOGY_VERSION, f"unsupported topology JSON version {version}")
    raw_gpus = data.get("gpus")
    _expect(isinstance(raw_gpus, list) and 0 < len(raw_gpus) <= 1024, "'gpus' must be a non-empty list")
    models = data.get("models", [])
    _expect(isinstance(models, list) and all(isinstance(m, str) for m in models), "'models' must be a list of strings")
    gpus = []
    for i, row in enumerate(raw_gpus):
        _expect(isinstance(row, list) and len(row) == 6, f"gpus[{i}] must be a list of 6 fields")
        gid, bus, numa, ref, mem, aff = row
        _expect(isinstance(gid, str) and 0 < len(gid) <= 63, f"gpus[{i}] id must be a string of 1-63 characters")
        _opt(bus, str, f"gpus[{i}] pci bus id")
        _opt(numa, int, f"gpus[{i}] numa node")
        _opt(ref, int, f"gpus[{i}] model reference")
        _opt(mem, int, f"gpus[{i}] memory")
        _opt(aff, str, f"gpus[{i}] cpu affinity")
        _expect(ref is None or 0 <= ref < len(models), f"gpus[{i}] model reference {ref} out of range")
        gpus.append(Gpu(i, gid, bus, models[ref] if ref is not None else None, mem, numa, aff))
    n = len(gpus)
    tokens = data.get("links")
    want = n * (n - 1) // 2
    _expect(isinstance(tokens, list) and len(tokens) == want, f"'links' must list {want} pairs for {n} GPUs")
    matrix: list[list[Link | None]] = [[None] * n for _ in range(n)]
    k = 0
    for i in range(n):
        for j in range(i + 1, n):
            tok = tokens[k]
            _expect(isinstance(tok, str), f"links[{k}] must be a string")
            try:
                link = link_from_token(tok)
            except TopologyError as e:
                raise TopologyFormatError(f"links[{k}] (GPU{i}-GPU{j}): {e}") from None
            matrix[i][j] = matrix[j][i] = link
            k += 1
    raw_nics = data.get("nics", [])
    _expect(isinstance(raw_nics, list) and len(raw_nics) <= MAX_NICS, f"'nics' must be a list of at most {MAX_NICS}")
    attrs = _nic_attributes(data.get("nicattr"), len(raw_nics))
    nics = []
    for m, entry in enumerate(raw_nics):
        ok = isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)
        _expect(ok, f"nics[{m}] must be [name, links]")
        try:
            kinds = tuple(_NIC_KIND[x] for x in entry[1])
        except KeyError:
            raise TopologyFormatError(f"nics[{m}] has an unknown PCIe class in {entry[1]!r}") from None
        rdma, rate = attrs[m]
        try:
            nics.append(Nic(entry[0], kinds, rdma, rate))
        except TopologyError as e:
            raise TopologyFormatError(f"nics[{m}]: {e}") from None
    pcie = data.get("pcie", 4)
    sock = data.get("sock", 16.0)
    _expect(isinstance(pcie, int) and not isinstance(pcie, bool), "'pcie' must be an integer")
    _expect(isinstance(sock, (int, float)) and not isinstance(sock, bool), "'sock' must be a number")
    try:
        return Topology.build(gpus, matrix, nics, pcie, float(sock))
    except TopologyFormatError:
        raise
    except TopologyError as e:
        raise TopologyFormatError(str(e)) from None


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _nic_attributes(raw: Any, count: int) -> list[tuple[bool | None, float | None]]:
    """(rdma, link Gb/s) per NIC from "nicattr"; all unknown when the key is absent (written before it existed)."""
    if raw is None:
        return [(None, None)] * count
    _expect(isinstance(raw, list) and len(raw) == count, f"'nicattr' must list {count} entries, one per NIC")
    out: list[tuple[bool | None, float | None]] = []
    for m, entry in enumerate(raw):
        _expect(isinstance(entry, list) and len(entry) == 2, f"nicattr[{m}] must be [rdma, link Gb/s]")
        rdma, rate = entry
        _expect(rdma in (None, 0, 1) and not isinstance(rdma, float), f"nicattr[{m}] rdma must be 1, 0 or null")
        number = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        _expect(rate is None or number, f"nicattr[{m}] link rate must be a number of Gb/s or null")
        out.append((None if rdma is None else bool(rdma), None if rate is None else float(rate)))
    return out


def topology_from_json(text: str | bytes) -> Topology:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise TopologyFormatError(f"topology annotation is not JSON: {str(e)[:200]}") from None
    return topology_from_dict(data)


SHARING_STRATEGIES = ("time-slicing", "mps")
MAX_REPLICAS = 1024  # per GPU; NVIDIA's schema has no bound, a bound keeps a hostile annotation from costing memory


@dataclass(frozen=True)
class SharedGpu:
    """One physical GPU advertised as replicas of a shared resource, and how many of them pods hold."""

    gpu: str
    replicas: int
    used: int

    @property
    def free(self) -> int:
        return self.replicas - self.used


@dataclass(frozen=True)
class SharedResource:
    """A resource name the node advertises as replicas (`nvidia.com/gpu`, or a renamed one such as
    `nvidia.com/gpu.shared`), with its GPUs in the order the plugin lists them."""

    name: str
    gpus: tuple[SharedGpu, ...]


@dataclass(frozen=True)
class Sharing:
    """How a node shares its GPUs: one strategy per node (NVIDIA's rule: time-slicing and MPS are exclusive)."""

    strategy: str
    fail_requests_greater_than_one: bool
    resources: tuple[SharedResource, ...]

    def resource(self, name: str) -> SharedResource | None:
        return next((r for r in self.resources if r.name == name), None)

    @property
    def shared_gpus(self) -> frozenset[str]:
        """Every GPU advertised as replicas: none of them is offered whole."""
        return frozenset(g.gpu for r in self.resources for g in r.gpus)


MIG_VERSION = 1
MIG_STRATEGIES = ("none", "single", "mixed")
MAX_MIG_GPUS = 64  # a node; bounds what a hostile annotation can make a reader build
MAX_MIG_INSTANCES = MEMORY_SLICES  # per GPU: at most one per memory slice
MAX_MIG_REASON = 400
MAX_MIG_PEERS = 64


@dataclass(frozen=True)
class MigInstance:
    """One MIG device: its name (`1g.18gb`, `1c.2g.35gb`), placement, MIG UUID, the resource it is advertised as
    (None: not advertised), and whether a pod holds it."""

    profile: str
    start: int
    size: int
    uuid: str
    resource: str | None
    used: bool


@dataclass(frozen=True)
class MigGpuInfo:
    """A MIG-enabled GPU: UUID, NVML index, NUMA node and NVLink island (None: unknown), model, its instances, and
    the other GPUs of its island (`peers`: whole GPUs by topology id, MIG GPUs by UUID)."""

    gpu: str
    index: int
    numa: int | None
    island: int | None
    model: str | None
    instances: tuple[MigInstance, ...]
    peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mig:
    """A node's MIG GPUs as the plugin advertises them: NVIDIA's strategy, why they are not advertised (strategy
    `none`), the GPUs."""

    strategy: str
    reason: str | None
    gpus: tuple[MigGpuInfo, ...]

    @property
    def used_ids(self) -> frozenset[str]:
        return frozenset(i.uuid for g in self.gpus for i in g.instances if i.used)


@dataclass(frozen=True)
class NodeState:
    """What is taken on a node: GPU ids held whole (from the kubelet's PodResources), unhealthy ids, and the
    replicas of shared GPUs and how many are held (None on a node that shares nothing), and its MIG instances
    (None on a node without MIG)."""

    generation: int
    used: frozenset[str]
    unhealthy: frozenset[str]
    sharing: Sharing | None = None
    mig: Mig | None = None


def sharing_to_dict(sharing: Sharing) -> dict[str, Any]:
    return {
        "strategy": sharing.strategy,
        "failRequestsGreaterThanOne": sharing.fail_requests_greater_than_one,
        "resources": [{"name": r.name, "gpus": [[g.gpu, g.replicas, g.used] for g in r.gpus]}
                      for r in sharing.resources],
    }


def state_to_json(state: NodeState) -> str:
    body: dict[str, Any] = {"v": STATE_VERSION, "gen": state.generation, "used": sorted(state.used),
                            "unhealthy": sorted(state.unhealthy)}
    if state.sharing is not None:
        body["sharing"] = sharing_to_dict(state.sharing)
    if state.mig is not None:
        body["mig"] = mig_to_dict(state.mig)
    return json.dumps(body, separators=(",", ":"))


def mig_to_dict(mig: Mig) -> dict[str, Any]:
    return {
        "v": MIG_VERSION,
        "strategy": mig.strategy,
        "reason": mig.reason,
        "gpus": [{"gpu": g.gpu, "index": g.index, "numa": g.numa, "island": g.island, "model": g.model,
                  **({"peers": list(g.peers)} if g.peers else {}),
                  "instances": [[i.profile, i.start, i.size, i.uuid, i.resource, int(i.used)] for i in g.instances]}
                 for g in mig.gpus],
    }


def _text(value: Any, what: str, limit: int, optional: bool = False) -> Any:
    ok = (value is None and optional) or (isinstance(value, str) and 0 < len(value) <= limit)
    _expect(ok, f"{what} must be {'null or ' if optional else ''}a string of 1-{limit} characters")
    return value


def _mig_instance(raw: Any, where: str) -> tuple[MigInstance, ProfileName]:
    """The instance and its parsed device name (the overlap check reads its slices)."""
    _expect(isinstance(raw, list) and len(raw) == 6,
            f"{where} must be [device name, start, size, MIG UUID, resource or null, used 0|1]")
    profile, start, size, uuid, resource, used = raw
    _text(profile, f"{where} device name", 32)
    try:
        name = parse_profile_name(profile)
        placement = Placement(_count(start, f"{where} start", 0, MEMORY_SLICES - 1),
                              _count(size, f"{where} size", 1, MEMORY_SLICES))
    except MigError as e:
        raise TopologyFormatError(f"{where}: {e}"[:300]) from None
    _text(uuid, f"{where} MIG UUID", 128)
    _text(resource, f"{where} resource", 253, optional=True)
    _expect(resource is None or "/" in resource, f"{where} resource must be domain/name or null")
    _expect(used in (0, 1) and not isinstance(used, float), f"{where} used must be 1 or 0")
    return MigInstance(profile, placement.start, placement.size, uuid, resource, bool(used)), name


def mig_from_dict(data: Any) -> Mig:
    """Read the state's "mig" member; raises TopologyFormatError naming the field that is wrong (the annotation may
    have been written by anyone with patch on nodes)."""
    _expect(isinstance(data, dict), "state 'mig' must be an object")
    version = data.get("v")
    _expect(isinstance(version, int) and not isinstance(version, bool), "state mig has no integer version 'v'")
    _expect(version <= MIG_VERSION, f"state mig version {version} is newer than this build reads ({MIG_VERSION})")
    _expect(version == MIG_VERSION, f"unsupported state mig version {version}")
    strategy = data.get("strategy")
    _expect(strategy in MIG_STRATEGIES, f"state mig 'strategy' must be one of {', '.join(MIG_STRATEGIES)}")
    reason = _text(data.get("reason"), "state mig 'reason'", MAX_MIG_REASON, optional=True)
    raw = data.get("gpus")
    _expect(isinstance(raw, list) and len(raw) <= MAX_MIG_GPUS, f"state mig 'gpus' must list at most {MAX_MIG_GPUS}")
    gpus: list[MigGpuInfo] = []
    gpu_ids: set[str] = set()
    indices: set[int] = set()
    uuids: set[str] = set()
    profile_of: dict[str, str] = {}  # resource -> the device name it serves (one per resource, as NVIDIA's)
    for k, g in enumerate(raw):
        where = f"state mig gpus[{k}]"
        _expect(isinstance(g, dict), f"{where} must be an object")
        gpu = _text(g.get("gpu"), f"{where} 'gpu'", 128)
        _expect(gpu not in gpu_ids, f"{where}: GPU {gpu!r} is listed twice")
        gpu_ids.add(gpu)
        index = _count(g.get("index"), f"{where} 'index'", 0, 1023)
        _expect(index not in indices, f"{where}: GPU index {index} is listed twice")
        indices.add(index)
        numa = g.get("numa")
        island = g.get("island")
        if numa is not None:
            _count(numa, f"{where} 'numa'", 0, 1023)
        if island is not None:
            _count(island, f"{where} 'island'", 0, 1023)
        model = _text(g.get("model"), f"{where} 'model'", 128, optional=True)
        peers = g.get("peers", [])
        _expect(isinstance(peers, list) and len(peers) <= MAX_MIG_PEERS
                and all(isinstance(p, str) and 0 < len(p) <= 128 for p in peers),
                f"{where} 'peers' must list at most {MAX_MIG_PEERS} GPU ids")
        _expect(not peers or island is not None, f"{where} lists 'peers' without an 'island'")
        insts = g.get("instances")
        _expect(isinstance(insts, list) and len(insts) <= MAX_MIG_INSTANCES,
                f"{where} 'instances' must list at most {MAX_MIG_INSTANCES}")
        taken = 0
        # compute instances of one GPU instance share its placement: (the GI's slices, theirs taken), by placement
        shared_gi: dict[tuple[int, int], tuple[int, int]] = {}
        instances = []
        for j, r in enumerate(insts):
            inst, name = _mig_instance(r, f"{where} instances[{j}]")
            mask = Placement(inst.start, inst.size).mask
            gi = (inst.start, inst.size)
            label = f"{where} instances[{j}] ({inst.profile} at {{{inst.start}}}:{inst.size})"
            if taken & mask and gi in shared_gi and name.compute_slices is not None:
                slices, used = shared_gi[gi]
                _expect(name.gi_slices == slices, f"{label}: a compute instance of a {name.gi_slices}-slice GPU "
                                                  f"instance where another names {slices} slices")
                _expect(used + name.compute_slices <= slices,
                        f"{label}: the compute instances of that GPU instance take more than its {slices} slices")
                shared_gi[gi] = (slices, used + name.compute_slices)
            else:
                _expect(not taken & mask, f"{label} overlaps another instance")
                if name.compute_slices is not None:
                    shared_gi[gi] = (name.gi_slices, name.compute_slices)
            taken |= mask
            _expect(inst.uuid not in uuids, f"{where} instances[{j}]: MIG UUID {inst.uuid!r} is listed twice")
            uuids.add(inst.uuid)
            if inst.resource is not None:
                seen = profile_of.setdefault(inst.resource, inst.profile)
                _expect(seen == inst.profile, f"{where} instances[{j}]: resource {inst.resource!r} serves both "
                                              f"{seen} and {inst.profile}")
            instances.append(inst)
        gpus.append(MigGpuInfo(gpu, index, numa, island, model, tuple(instances), tuple(peers)))
    _expect(strategy != "none" or not profile_of, "state mig strategy 'none' advertises no resource")
    return Mig(strategy, reason, tuple(gpus))


def _count(value: Any, what: str, low: int, high: int) -> int:
    _expect(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
            f"{what} must be an integer from {low} to {high}, got {value!r}"[:300])
    return value


def sharing_from_dict(data: Any) -> Sharing:
    """Read the state's "sharing" member; raises TopologyFormatError naming the field that is wrong."""
    _expect(isinstance(data, dict), "state 'sharing' must be an object")
    strategy = data.get("strategy")
    _expect(strategy in SHARING_STRATEGIES, f"state sharing 'strategy' must be one of {', '.join(SHARING_STRATEGIES)}")
    fail = data.get("failRequestsGreaterThanOne", False)
    _expect(isinstance(fail, bool), "state sharing 'failRequestsGreaterThanOne' must be a boolean")
    raw = data.get("resources")
    _expect(isinstance(raw, list) and 0 < len(raw) <= 64, "state sharing 'resources' must list 1-64 resources")
    resources = []
    seen_gpus: set[str] = set()
    names: set[str] = set()
    for i, r in enumerate(raw):
        _expect(isinstance(r, dict), f"state sharing resources[{i}] must be an object")
        name = r.get("name")
        _expect(isinstance(name, str) and 0 < len(name) <= 253, f"state sharing resources[{i}] needs a 'name'")
        _expect(name not in names, f"state sharing resource {name!r} is listed twice")
        names.add(name)
        gpus = r.get("gpus")
        _expect(isinstance(gpus, list) and 0 < len(gpus) <= 1024, f"state sharing {name!r} 'gpus' must list 1-1024")
        entries = []
        for j, g in enumerate(gpus):
            where = f"state sharing {name!r} gpus[{j}]"
            _expect(isinstance(g, list) and len(g) == 3 and isinstance(g[0], str) and g[0],
                    f"{where} must be [gpu id, replicas, used]")
            _expect(g[0] not in seen_gpus, f"{where}: GPU {g[0]!r} is shared under two entries")
            seen_gpus.add(g[0])
            replicas = _count(g[1], f"{where} replicas", 1, MAX_REPLICAS)
            used = _count(g[2], f"{where} used", 0, replicas)
            entries.append(SharedGpu(g[0], replicas, used))
        resources.append(SharedResource(name, tuple(entries)))
    return Sharing(strategy, fail, tuple(resources))


def state_from_json(text: str | bytes) -> NodeState:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise TopologyFormatError(f"state annotation is not JSON: {str(e)[:200]}") from None
    _expect(isinstance(data, dict), "state JSON must be an object")
    version = data.get("v")
    _expect(isinstance(version, int) and not isinstance(version, bool), "state JSON has no integer version 'v'")
    if version > STATE_VERSION:
        raise TopologyFormatError(f"state JSON version {version} is newer than this build reads ({STATE_VERSION})")
    gen = data.get("gen", 0)
    _expect(isinstance(gen, int) and not isinstance(gen, bool), "state 'gen' must be an integer")
    lists = {}
    for key in ("used", "unhealthy"):
        value = data.get(key, [])
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        _expect(ok, f"state '{key}' must be a list of ids")
        lists[key] = frozenset(value)
    sharing = sharing_from_dict(data["sharing"]) if data.get("sharing") is not None else None
    if sharing is not None:
        both = lists["used"] & sharing.shared_gpus
        _expect(not both, f"state lists shared GPU {min(both, default='')!r} as used whole")
    mig = mig_from_dict(data["mig"]) if data.get("mig") is not None else None
    if mig is not None:
        whole = lists["used"] & {g.gpu for g in mig.gpus}
        _expect(not whole, f"state lists MIG GPU {min(whole, default='')!r} as used whole")
    return NodeState(gen, lists["used"], lists["unhealthy"], sharing, mig)

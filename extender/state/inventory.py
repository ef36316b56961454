"""Standalone mode: nodes, topologies and used GPUs from a YAML inventory instead of an apiserver.

Used by the end-to-end demo and the benchmarks. Bind records the plan in memory and marks its GPUs used at once (no
reservation is needed: nothing lags behind); GET /inventory shows the state, DELETE /inventory/pods/{uid} frees a
pod's GPUs as if it had finished.

Format (see examples/inventory.yaml):
    nodes:
      - name: dgx-1                       # required
        topology: topologies/dgx.txt      # path, relative to the inventory file: any form load_topology_file reads
        # or topology_inline: "<nvidia-smi topo -m text, or compact topology JSON>"
        used: [GPU0, 1]                   # optional: GPU ids, or indices
        unhealthy: []                     # optional
        unschedulable: false              # optional
        labels: {example.com/rack: r1}    # optional: node labels, for the --locality levels of job plans
        replicas: 3                       # optional: dgx-1-0, dgx-1-1, dgx-1-2 with the same spec
        sharing:                          # optional: GPUs shared as replicas (time-slicing or MPS), as the plugin
          strategy: time-slicing          #   publishes them; mps | time-slicing
          failRequestsGreaterThanOne: false
          resources:
            - name: nvidia.com/gpu.shared
              replicas: 4                 # per GPU
              devices: [0, 1, 2, 3]       # optional: GPU ids or indices (default: every GPU)
              used: {0: 2}                # optional: replicas held per GPU (id or index)
        mig:                              # optional: MIG GPUs (issue 23), the state's "mig" member as the plugin
          strategy: mixed                 #   publishes it (docs/contracts.md); none | single | mixed
          gpus:
            - {gpu: GPU-2, index: 2, numa: 0, model: NVIDIA H200,
               instances: [[1g.18gb, 0, 1, MIG-a, nvidia.com/mig-1g.18gb, 0], ...]}
A node with `mig` may leave out its topology (every GPU MIG: no whole GPU to place).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import structlog
import yaml

from extender.state.cache import NodeCache, NodeEntry, PodRecord, make_entry
from extender.state.mig import NodeMig, node_mig, with_held
from extender.state.sharing import node_sharing, with_used
from gputopo.contract import Plan, encode_plan
from gputopo.core import Topology, TopologyError
from gputopo.core.bitset import bits
from gputopo.core.codec import (
    MIG_VERSION,
    SharedGpu,
    SharedResource,
    Sharing,
    mig_from_dict,
    mig_to_dict,
    sharing_from_dict,
    sharing_to_dict,
)
from gputopo.core.locality import Locality
from gputopo.discovery.loader import load_topology_file, load_topology_text

log = structlog.get_logger(__name__)

_NODE_KEYS = frozenset({"name", "topology", "topology_inline", "used", "unhealthy", "unschedulable", "replicas",
                        "labels", "sharing", "mig"})
_SHARING_KEYS = frozenset({"strategy", "failRequestsGreaterThanOne", "resources"})
_SHARED_KEYS = frozenset({"name", "replicas", "devices", "used"})
MAX_REPLICAS = 100_000


class InventoryError(ValueError):
    """The inventory file is unreadable or names something wrong; the message says which node and field."""


def _ids(topo: Topology, values: Any, where: str) -> list[str]:
    if values is None:
        return []
    if not isinstance(values, list):
        raise InventoryError(f"{where} must be a list of GPU ids or indices")
    out = []
    for v in values:
        if isinstance(v, bool):
            raise InventoryError(f"{where}: {v!r} is not a GPU id or index")
        if isinstance(v, int):
            if not 0 <= v < topo.size:
                raise InventoryError(f"{where}: GPU index {v} is outside 0..{topo.size - 1}")
            out.append(topo.gpus[v].id)
        elif isinstance(v, str) and v in topo.ids:
            out.append(v)
        else:
            raise InventoryError(f"{where}: {v!r} is not a GPU of this node (ids: {', '.join(topo.ids)})")
    return out


def _labels(values: Any, where: str) -> dict[str, str]:
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise InventoryError(f"{where} labels must map label keys to string values")
    return values


def _mapping(spec: Any, where: str, allowed: frozenset[str]) -> None:
    """Raises InventoryError unless `spec` is a mapping whose keys are all `allowed`."""
    if not isinstance(spec, dict):
        raise InventoryError(f"{where} must be a mapping")
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise InventoryError(f"{where} has unknown keys {unknown} (allowed: {sorted(allowed)})")


def _sharing(topo: Topology, spec: Any, where: str) -> Sharing | None:
    """The node's `sharing` block, read into the contract's Sharing (so it is checked as the plugin's state is)."""
    if spec is None:
        return None
    where = f"{where} sharing"
    _mapping(spec, where, _SHARING_KEYS)
    raw = spec.get("resources")
    if not isinstance(raw, list):
        raise InventoryError(f"{where} needs a 'resources' list")
    resources = []
    for k, r in enumerate(raw):
        at = f"{where} resources[{k}]"
        if not isinstance(r, dict) or sorted(set(r) - _SHARED_KEYS):
            raise InventoryError(f"{at} must be a mapping with keys among {sorted(_SHARED_KEYS)}")
        name = r.get("name")
        if not isinstance(name, str) or not name:
            raise InventoryError(f"{at} needs a resource 'name'")
        replicas = r.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise InventoryError(f"{at} replicas must be an integer")
        devices = _ids(topo, r.get("devices"), f"{at} devices") if r.get("devices") is not None else list(topo.ids)
        used_raw = r.get("used") or {}
        if not isinstance(used_raw, dict):
            raise InventoryError(f"{at} used must map GPUs to replica counts")
        used = {}
        for gpu, n in used_raw.items():
            (gid,) = _ids(topo, [gpu], f"{at} used")
            used[gid] = n
        stray = sorted(set(used) - set(devices))
        if stray:
            raise InventoryError(f"{at} used names GPUs it does not share: {stray}")
        resources.append(SharedResource(name, tuple(SharedGpu(g, replicas, used.get(g, 0))
                                                                  for g in devices)))
    sharing = Sharing(spec.get("strategy"), spec.get("failRequestsGreaterThanOne", False),  # type: ignore[arg-type]
                      tuple(resources))
    try:  # the contract's own reader checks names, counts and GPUs shared twice
        return sharing_from_dict(sharing_to_dict(sharing))
    except TopologyError as e:
        raise InventoryError(f"{where}: {e}") from None


def parse_inventory(data: Any, base_dir: Path, locality: Locality | None = None) -> list[NodeEntry]:
    """Node entries from the inventory's parsed YAML (`locality` reads each node's place from its labels). Raises
    InventoryError."""
    locality = locality or Locality()
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise InventoryError("inventory must be a mapping with a 'nodes' list")
    topologies: dict[str, Topology] = {}
    entries: list[NodeEntry] = []
    names: set[str] = set()
    for k, spec in enumerate(data["nodes"]):
        where = f"nodes[{k}]"
        _mapping(spec, where, _NODE_KEYS)
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InventoryError(f"{where} needs a non-empty 'name'")
        where = f"node {name}"
        mig = _mig(spec.get("mig"), where)
        if mig is not None and spec.get("topology") is None and spec.get("topology_inline") is None:
            _mig_only_node(spec, where)
            for n in _replica_names(name, spec.get("replicas"), where):
                if n in names:
                    raise InventoryError(f"node name {n} appears twice")
                names.add(n)
                entries.append(make_entry(n, None, problem="publishes no GPU topology (every GPU is MIG)",
                                          unschedulable=spec.get("unschedulable") is True, mig=mig))
            continue
        topo = _topology(spec, base_dir, where, topologies)
        used = _ids(topo, spec.get("used"), f"{where} used")
        unhealthy = _ids(topo, spec.get("unhealthy"), f"{where} unhealthy")
        unschedulable = spec.get("unschedulable", False)
        if not isinstance(unschedulable, bool):
            raise InventoryError(f"{where} unschedulable must be true or false")
        replicas = spec.get("replicas")
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                     or not 1 <= replicas <= MAX_REPLICAS):
            raise InventoryError(f"{where} replicas must be an integer in 1..{MAX_REPLICAS}")
        place = locality.place(_labels(spec.get("labels"), where))
        shared = _sharing(topo, spec.get("sharing"), where)
        view = node_sharing(shared, {g.id: g.index for g in topo.gpus})[0] if shared is not None else None
        if view is not None and set(used) & {topo.gpus[i].id for i in bits(view.mask)}:
            raise InventoryError(f"{where} lists a shared GPU as used whole: shared GPUs are held only as replicas")
        node_names = [name] if replicas is None else [f"{name}-{i}" for i in range(replicas)]
        for n in node_names:
            if n in names:
                raise InventoryError(f"node name {n} appears twice")
            names.add(n)
            entries.append(make_entry(n, topo, used=used, unhealthy=unhealthy, unschedulable=unschedulable,
                                      place=place, sharing=view, mig=mig))
    return entries


def _replica_names(name: str, replicas: Any, where: str) -> list[str]:
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or not 1 <= replicas <= MAX_REPLICAS):
        raise InventoryError(f"{where} replicas must be an integer in 1..{MAX_REPLICAS}")
    return [name] if replicas is None else [f"{name}-{i}" for i in range(replicas)]


def _mig_only_node(spec: Mapping[str, Any], where: str) -> None:
    """A MIG node without a topology: only the keys that mean something without whole GPUs."""
    extra = sorted(set(spec) - {"name", "mig", "replicas", "unschedulable"})
    if extra:
        raise InventoryError(f"{where} has no topology (MIG only): {', '.join(extra)} need one")
    if not isinstance(spec.get("unschedulable", False), bool):
        raise InventoryError(f"{where} unschedulable must be true or false")


def _mig(spec: Any, where: str) -> NodeMig | None:
    """The node's `mig` block, read by the contract's own reader (so it is checked as the plugin's state is)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise InventoryError(f"{where} mig must be a mapping")
    try:
        return node_mig(mig_from_dict({"v": MIG_VERSION, **spec}))
    except TopologyError as e:
        raise InventoryError(f"{where} mig: {e}") from None


def _topology(spec: Mapping[str, Any], base_dir: Path, where: str, seen: dict[str, Topology]) -> Topology:
    path, inline = spec.get("topology"), spec.get("topology_inline")
    if (path is None) == (inline is None):
        raise InventoryError(f"{where} needs exactly one of 'topology' (a file) or 'topology_inline'")
    try:
        if path is not None:
            if not isinstance(path, str) or not path:
                raise InventoryError(f"{where} topology must be a file path")
            full = (base_dir / path).resolve()
            key = f"file:{full}"
            if key not in seen:
                seen[key] = load_topology_file(full)
        else:
            if not isinstance(inline, str) or not inline.strip():
                raise InventoryError(f"{where} topology_inline must be non-empty text")
            key = f"inline:{inline}"
            if key not in seen:
                seen[key] = load_topology_text(inline, source=f"{where} topology_inline")
    except TopologyError as e:
        raise InventoryError(f"{where}: {e}") from None
    return seen[key]


def load_inventory(path: str | Path, locality: Locality | None = None) -> list[NodeEntry]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise InventoryError(f"cannot read inventory {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise InventoryError(f"inventory {p} is not valid YAML: {e}") from None
    return parse_inventory(data, p.parent, locality)


class Inventory:
    """The in-memory cluster of standalone mode: binds mark GPUs used, releases free them."""

    def __init__(self, cache: NodeCache, entries: list[NodeEntry], source: str = "") -> None:
        self.cache = cache
        self.source = source
        self._lock = threading.Lock()
        self.bound: dict[str, PodRecord] = {}
        for e in entries:
            cache.put_node(e)

    def commit(self, entry: NodeEntry | None, rec: PodRecord) -> None:
        """Mark the pod bound, and its plan's GPUs (or replicas) used on the node (a pod without GPUs has no plan and
        needs no entry: it is remembered all the same, so a second bind elsewhere is refused as for a GPU pod). The
        caller holds the node's lock."""
        if rec.plan is not None:
            assert entry is not None and (entry.topo is not None or entry.mig is not None)
            self.cache.put_node(self._moved(entry, rec.plan, +1))
        self.cache.remember_pod(rec)
        with self._lock:
            self.bound[rec.uid] = rec

    def release(self, uid: str) -> PodRecord | None:
        """Free a bound pod's GPUs (the pod finished). None if no such pod."""
        with self._lock:
            rec = self.bound.pop(uid, None)
        if rec is None or rec.node is None:
            return rec
        with self.cache.lock_for(rec.node):
            entry = self.cache.nodes.get(rec.node)
            if entry is not None and (entry.topo is not None or entry.mig is not None) and rec.plan is not None:
                self.cache.put_node(self._moved(entry, rec.plan, -1))
        self.cache.remove_pod(uid)
        return rec

    @staticmethod
    def _moved(entry: NodeEntry, plan: Plan, sign: int) -> NodeEntry:
        """The entry with the plan's GPUs taken (+1) or given back (-1): whole GPUs as used ids, replicas of a
        shared resource as one more (or fewer) used replica on each planned GPU, MIG instances as held (or free)."""
        if entry.mig is not None and entry.mig.used | {i.uuid for g in entry.mig.gpus for i in g.instances} >= plan.ids:
            mig = with_held(entry.mig, plan.ids, sign > 0)
            return make_entry(entry.name, entry.topo, problem=entry.problem, index=entry.index or None,
                              used=entry.used_ids, unhealthy=entry.unhealthy_ids, unschedulable=entry.unschedulable,
                              generation=entry.generation + 1, place=entry.place, sharing=entry.sharing, mig=mig,
                              removal=entry.removal)
        assert entry.topo is not None
        used, sharing = entry.used_ids, entry.sharing
        if entry.shares(plan.resource):
            assert sharing is not None
            delta = {entry.index[g]: sign for g in plan.ids}
            sharing = with_used(sharing, {g.index: g.id for g in entry.topo.gpus}, delta)
        else:
            used = used | plan.ids if sign > 0 else used - plan.ids
        return make_entry(entry.name, entry.topo, index=entry.index, used=used, unhealthy=entry.unhealthy_ids,
                          unschedulable=entry.unschedulable, generation=entry.generation + 1, place=entry.place,
                          sharing=sharing, mig=entry.mig, removal=entry.removal)

    def snapshot(self) -> dict[str, Any]:
        nodes = []
        reserved = self.cache.reservations.masks
        for name, e in sorted(self.cache.nodes.items()):
            mig = {"mig": mig_to_dict(e.mig.mig)} if e.mig is not None else {}
            if e.topo is None:
                nodes.append({"name": name, "problem": e.problem, **mig})
                continue
            free = e.base_free & ~reserved.get(name, 0)
            nodes.append({
                "name": name,
                "gpus": e.topo.size,
                "fabric": e.topo.fabric,
                "used": sorted(e.used_ids),
                "unhealthy": sorted(e.unhealthy_ids),
                "free": [e.topo.gpus[i].id for i in bits(free)],
                "unschedulable": e.unschedulable,
                **({"shared": {r.resource: [[e.topo.gpus[g].id, rep, u] for g, rep, u in
                                            zip(r.gpus, r.replicas, r.used, strict=True)]
                               for r in e.sharing.resources}} if e.sharing is not None else {}),
                **mig,
            })
        with self._lock:
            pods = [{"uid": r.uid, "namespace": r.namespace, "name": r.name, "node": r.node,
                     "plan": _plan_json(r.plan)} for r in self.bound.values()]
        return {"source": self.source, "nodes": nodes, "pods": pods}


def _plan_json(plan: Plan | None) -> Any:
    return None if plan is None else orjson.loads(encode_plan(plan))

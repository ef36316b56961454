"""Extender failover and restarts against a real control plane: `python -m bench.failover [--pods 300]
[--kill KIND|both|all] [--nodes N] [--runs N | --sweep K] [--burners B]`.

Two `gpu-extender serve --leader-elect` replicas, a real kube-apiserver (etcd) and a real kube-scheduler v1.36.2
(tests/helpers/controlplane.py; binaries from shared/kube beside the clone) reaching them through a Service stand-in
that follows the `gpu-topology.io/extender-role=leader` label (tests/helpers/service_proxy.py). A burst of GPU pods
is created at once; after `--kill-after` binds the leader is killed, one KIND per run:
- `sigterm`: SIGTERM to the main process, as the kubelet sends it (the Lease is released on the way out);
- `sigterm-group`: SIGTERM to the whole process group (an init or a shell entrypoint that forwards signals);
- `sigkill`: SIGKILL to the whole process group, as a container dies (the Lease must expire, 15 s);
- `restart`: one replica without election, SIGKILLed and started again at once, as the kubelet restarts a crashed
  container: it must answer nothing until its view holds every bound pod again.
A killed replica is started again as soon as it is gone (a Deployment's replacement), so every run also meets a
replica starting beside a leader. `--sweep K` kills after K different bind counts spread across the burst instead of
`--runs` at one count; `--burners B` runs B processes burning CPU throughout. Measured from
kube-scheduler's `Successfully bound pod to node` log lines (its clock) and from a pod watch (ours): binds/s before
the kill, the gap around it, the time until every pod is bound, pods left pending, kube-scheduler's failed attempts.
Then the proof that no GPU was given twice: every bound pod's plan annotation names GPU ids on its node; no id may
appear in two plans of one node, and no node may hold more GPUs than it has.

There is no kubelet and no device plugin: Nodes never publish the GPUs as used, so a plan holds its GPUs as a
reservation (bound pod) until the pod ends; --reservation-timeout is 600 s so that nothing expires during a run.
Results: bench/results/failover.{md,json,png}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.common import RESULTS, ROOT, burning, keep_logs, machine_line, markdown_table, percentile

if TYPE_CHECKING:  # the harness is imported lazily, so that --help works anywhere
    from tests.helpers.controlplane import ControlPlane, Proc

GPU = "nvidia.com/gpu"
PREFIX = "gpu-topology.io"
PLAN = f"{PREFIX}/plan"
ROLE = f"{PREFIX}/extender-role"
CONTROL_NODE = "control-plane-0"
HOLD = "bench.gpu-topology.io/after-the-kill"  # scheduling gate of the pods held until the leader is killed
SIZES = ((1, 0.5), (2, 0.25), (4, 0.15), (8, 0.10))  # GPUs per pod, share of the burst
BIND_LINE = re.compile(r'^I(\d{4}) (\d\d:\d\d:\d\d\.\d+)\s.*"Successfully bound pod to node" pod="([^"]+)"')


# -- the cluster -------------------------------------------------------------------------------------------------


def topology_files() -> list[Path]:
    """Real topologies: the complete nvidia-smi fixtures and the bundled data (DGX-1 cube mesh, NVSwitch, PCIe)."""
    from bench.common import complete_topology_files

    return [*complete_topology_files(), *sorted((ROOT / "gputopo" / "data").glob("*.txt"))]


def add_nodes(cp: ControlPlane, count: int, workers: int = 8) -> dict[str, int]:
    """`count` GPU nodes cycling through the real topologies, plus the non-GPU node the replica Pods sit on;
    returns GPUs per node."""
    from gputopo.discovery.loader import load_topology_file

    topos = [load_topology_file(p) for p in topology_files()]
    cp.add_node(CONTROL_NODE, labels={"node-role.kubernetes.io/control-plane": ""})
    names = {f"gpu-{i:03d}": topos[i % len(topos)] for i in range(count)}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda item: cp.add_gpu_node(item[0], item[1]), names.items()))
    return {n: t.size for n, t in names.items()}


def burst_sizes(pods: int, seed: int) -> list[int]:
    """GPUs per pod: the SIZES mix, shuffled with `seed` (the same burst for every run)."""
    sizes = [s for s, share in SIZES for _ in range(round(pods * share))]
    sizes = (sizes + [1] * pods)[:pods]
    random.Random(seed).shuffle(sizes)
    return sizes


def default_nodes(pods: int, seed: int) -> int:
    """Enough nodes that the burst asks for about two thirds of the GPUs (the mean node has 7.6)."""
    return max(10, round(sum(burst_sizes(pods, seed)) * 1.5 / 7.6))


# -- the replicas ------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    namespace: str
    port: int
    metrics_port: int
    proc: Proc

    def alive(self) -> bool:
        return self.proc.running()


def create_replica_pod(cp: ControlPlane, namespace: str, name: str, port: int) -> None:
    """The replica's Pod object, as a Deployment's pod would be once running: on the control-plane node, podIP
    127.0.0.1, Ready; its port in the Service stand-in's annotation (one IP here cannot tell replicas apart). A Pod
    that exists already (its container restarted) gets the new port."""
    from tests.helpers.service_proxy import PORT_ANNOTATION

    r = cp.api().post(f"/api/v1/namespaces/{namespace}/pods", json={
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "gpu-extender"},
                     "annotations": {PORT_ANNOTATION: str(port)}},
        "spec": {"nodeName": CONTROL_NODE, "containers": [{"name": "extender", "image": "registry.invalid/none:0"}]}})
    if r.status_code == 409:
        cp.patch(f"/api/v1/namespaces/{namespace}/pods/{name}", {"metadata": {"annotations": {
            PORT_ANNOTATION: str(port)}}})
    elif r.status_code != 201:
        raise RuntimeError(f"creating the replica's Pod {namespace}/{name}: {r.status_code} {r.text[:300]}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cp.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "hostIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


def start_replica(cp: ControlPlane, namespace: str, name: str, log_dir: Path, *, leader_elect: bool = True,
                  extra: Sequence[str] = (), tree: Path = ROOT, log_name: str = "",
                  lease: tuple[int, int, int] = (15, 10, 2)) -> Replica:
    """`gpu-extender serve` for Pod `name` (POD_NAME / POD_NAMESPACE set as the downward API would), in its own
    session so that a signal to the group reaches all it started, as in a container."""
    from sim.ports import free_ports
    from tests.helpers.controlplane import start_process, wait_until

    port, mport = free_ports(2)
    create_replica_pod(cp, namespace, name, port)
    argv = [sys.executable, "-m", "extender.cli", "serve", "--kubeconfig", str(cp.kubeconfig), "--port", str(port),
            "--metrics-port", str(mport), "--metrics-host", "127.0.0.1", "--reservation-timeout", "600",
            "--log-level", "info", *extra]
    if leader_elect:
        argv += ["--leader-elect", "--leader-elect-lease-duration", str(lease[0]), "--leader-elect-renew-deadline",
                 str(lease[1]), "--leader-elect-retry-period", str(lease[2])]
    env = {**os.environ, "POD_NAME": name, "POD_NAMESPACE": namespace, "PYTHONUNBUFFERED": "1"}
    proc = start_process(name, argv, log_dir / f"{log_name or name}.log", env=env, cwd=tree)  # `-m`: the tree's code
    replica = Replica(name, namespace, port, mport, proc)
    wait_until(f"{name} /healthz", lambda: httpx.get(f"http://127.0.0.1:{mport}/healthz", timeout=2)
               .status_code == 200, 90, proc, 0.2)
    return replica


KILLS = ("sigterm", "sigterm-group", "sigkill", "restart")


def kill_replica(replica: Replica, how: str, grace: float = 30.0) -> None:
    """sigkill and restart: the whole process group at once (a container killed, an OOM, a node lost). sigterm: the
    main process, as the kubelet does; sigterm-group: the whole group. Then SIGKILL of the group after `grace`
    (terminationGracePeriodSeconds)."""
    pid = replica.proc.pid
    if how in ("sigkill", "restart"):
        os.killpg(pid, signal.SIGKILL)
    elif how == "sigterm-group":
        os.killpg(pid, signal.SIGTERM)
    else:
        os.kill(pid, signal.SIGTERM)
    try:
        replica.proc.popen.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(pid, signal.SIGKILL)
        replica.proc.popen.wait(10)


def role_labels(cp: ControlPlane, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(ROLE, "")
            for p in cp.list_items(f"/api/v1/namespaces/{namespace}/pods")}


def lease_holder(cp: ControlPlane, namespace: str, name: str = "gpu-extender") -> str:
    r = cp.api().get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
    return str((r.json().get("spec") or {}).get("holderIdentity") or "") if r.status_code == 200 else ""


def wait_leader(cp: ControlPlane, namespace: str, replicas: Sequence[Replica], timeout: float,
                not_: str | None = None) -> str:
    """The replica whose Pod is labelled leader and that holds the Lease (and is not `not_`)."""
    from tests.helpers.controlplane import wait_until

    found: list[str] = []

    def check() -> bool:
        holder = lease_holder(cp, namespace)
        labels = role_labels(cp, namespace)
        for r in replicas:
            if r.name != not_ and r.alive() and holder.startswith(r.name) and labels.get(r.name) == "leader":
                found.append(r.name)
                return True
        return False

    wait_until(f"a leader among {[r.name for r in replicas if r.name != not_]}", check, timeout, None, 0.1)
    return found[-1]


def start_proxy(cp: ControlPlane, namespace: str, log_dir: Path, keep_connections: bool = False) -> tuple[Proc, int]:
    """The Service stand-in as its own process, listening on a free port; ready when it accepts."""
    from sim.ports import free_ports
    from tests.helpers.controlplane import start_process, wait_until
    from tests.helpers.processes import accepts

    (port,) = free_ports(1)
    proc = start_process("service-proxy", [sys.executable, "-m", "tests.helpers.service_proxy", "--kubeconfig",
                                           str(cp.kubeconfig), "--namespace", namespace, "--listen-port", str(port),
                                           *(["--keep-connections"] if keep_connections else [])],
                         log_dir / f"service-proxy-{namespace}.log", cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_until("service proxy listening", lambda: accepts(port), 30, proc)
    return proc, port


# -- watching binds ----------------------------------------------------------------------------------------------


class BindWatch:
    """A pod watch on the burst's namespace in a thread: the wall-clock time each pod was first seen bound."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.namespace = cp, namespace
        self.bound: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bind-watch", daemon=True)

    def start(self) -> BindWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started when the run failed before the burst: keep that error
            self._thread.join(15)

    def _run(self) -> None:
        client = self.cp.new_client(timeout=30)
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        try:
            while not self._stop.is_set():
                try:
                    listing = client.get(path).json()
                    for pod in listing.get("items") or []:
                        self._see(pod)
                    rv = listing["metadata"]["resourceVersion"]
                    with client.stream("GET", path, params={"watch": "1", "resourceVersion": rv,
                                                            "timeoutSeconds": "5", "allowWatchBookmarks": "false"},
                                       timeout=httpx.Timeout(30, read=10)) as r:
                        for line in r.iter_lines():
                            if self._stop.is_set():
                                return
                            if line:
                                event = json.loads(line)
                                if event.get("type") in ("ADDED", "MODIFIED"):
                                    self._see(event["object"])
                except (httpx.HTTPError, ValueError, KeyError):
                    time.sleep(0.2)
        finally:
            client.close()

    def _see(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if (pod.get("spec") or {}).get("nodeName") and name not in self.bound:
            self.bound[name] = time.time()


class LogCount:
    """Lines of a growing log holding `needle`, read incrementally: kube-scheduler's bind lines come before our watch
    sees the pods bound (it lags under load), so the kill lands nearer the intended bind count."""

    def __init__(self, path: Path, needle: str) -> None:
        self.path, self.needle = path, needle.encode()
        self.offset = 0
        self.seen = 0
        self.rest = b""

    def count(self) -> int:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        self.seen += sum(1 for line in lines if self.needle in line)
        return self.seen


def scheduler_binds(log: Path, namespace: str) -> dict[str, float]:
    """Pod name -> epoch seconds of kube-scheduler's `Successfully bound pod to node` line (klog time, local zone)."""
    year = datetime.datetime.now().year
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = BIND_LINE.match(line)
        if m and m.group(3).startswith(f"{namespace}/"):
            when = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            out.setdefault(m.group(3).split("/", 1)[1], when.timestamp())
    return out


# -- the proof ---------------------------------------------------------------------------------------------------


@dataclass
class Proof:
    bound: int = 0
    plans: int = 0
    missing_plan: list[str] = field(default_factory=list)
    wrong_node: list[str] = field(default_factory=list)
    wrong_count: list[str] = field(default_factory=list)
    given_twice: list[str] = field(default_factory=list)  # "node/gpu: pod, pod"
    over_allocatable: list[str] = field(default_factory=list)
    gpus_planned: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing_plan or self.wrong_node or self.wrong_count or self.given_twice
                    or self.over_allocatable)


def prove_no_double_allocation(cp: ControlPlane, namespace: str, allocatable: dict[str, int]) -> Proof:
    """Read every bound pod's plan: ids per node disjoint across pods, as many ids as the pod asks for, the plan's
    node the pod's node, and requests per node within allocatable."""
    from gputopo.contract import parse_plan

    proof = Proof()
    holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    requested: Counter[str] = Counter()
    for pod in cp.list_items(f"/api/v1/namespaces/{namespace}/pods"):
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            continue
        name = pod["metadata"]["name"]
        proof.bound += 1
        want = sum(int(((c.get("resources") or {}).get("limits") or {}).get(GPU, 0))
                   for c in pod["spec"]["containers"])
        requested[node] += want
        text = (pod["metadata"].get("annotations") or {}).get(PLAN)
        if not text:
            proof.missing_plan.append(name)
            continue
        plan = parse_plan(text)
        proof.plans += 1
        if plan.node != node:
            proof.wrong_node.append(f"{name}: plan {plan.node}, bound {node}")
        ids = [i for _, c in plan.containers for i in c]
        if len(ids) != want or len(set(ids)) != len(ids):
            proof.wrong_count.append(f"{name}: asks {want}, plan {ids}")
        proof.gpus_planned += len(ids)
        for gpu in set(ids):
            holders[(node, gpu)].append(name)
    proof.given_twice = [f"{n}/{g}: {', '.join(p)}" for (n, g), p in sorted(holders.items()) if len(p) > 1]
    proof.over_allocatable = [f"{n}: {r} > {allocatable.get(n, 0)}" for n, r in sorted(requested.items())
                              if r > allocatable.get(n, 0)]
    return proof


# -- one run -----------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    kill: str
    run: int
    pods: int
    nodes: int
    load_before: tuple[float, float, float]
    kill_after: int
    binds_before_kill: int = 0
    rate_before: float = 0.0
    gap_s: float = 0.0  # last bind before the kill -> first bind after it (scheduler log clock)
    longest_pause_after_kill_s: float = 0.0
    kill_to_new_leader_s: float = 0.0
    kill_to_first_bind_s: float = 0.0
    all_bound_s: float = 0.0  # from the burst's first create to the last bind
    pending: int = 0
    attempts: dict[str, float] = field(default_factory=dict)
    old_leader: str = ""
    new_leader: str = ""
    proof: dict[str, Any] = field(default_factory=dict)
    watch_vs_log_p50_ms: float = 0.0
    series: list[float] = field(default_factory=list)  # bind times relative to the burst start (log, else watch)
    kill_at: float = 0.0  # relative to the burst start
    proxy_changes: list[str] = field(default_factory=list)
    bound_without_log_line: list[str] = field(default_factory=list)
    written_after_release: int = 0  # Bindings the old leader wrote after it released the Lease (SIGTERM)
    error: str = ""


def run_once(cp: ControlPlane, *, run_id: str, kill: str, pods: int, sizes: Sequence[int],
             allocatable: dict[str, int], kill_after: int, log_dir: Path, timeout: float = 240.0,
             qps: float = 50, burst: int = 100, run_no: int = 1, keep_connections: bool = False,
             gated: int = 0, tree: Path = ROOT, lease: tuple[int, int, int] = (15, 10, 2)) -> RunResult:
    """One burst: fresh namespaces, replicas, proxy and kube-scheduler; kill the leader after `kill_after` binds
    (`kill` "none": no kill); every process this starts is stopped by pid before returning. The last `gated` pods
    carry a scheduling gate removed right after the kill, so that some binds surely fall to the new leader however
    fast the burst goes (a short burst can end before the kill lands)."""
    from tests.helpers.controlplane import extender_stanza

    ext_ns, pod_ns = f"gpu-topology-{run_id}", f"burst-{run_id}"
    cp.ensure_namespace(ext_ns)
    cp.ensure_namespace(pod_ns)
    result = RunResult(kill, run_no, pods, len(allocatable), os.getloadavg(), kill_after)
    replicas: list[Replica] = []
    proxy: Proc | None = None
    sched = None
    watch = BindWatch(cp, pod_ns)
    replaced: list[threading.Thread] = []
    try:
        elect = kill not in ("none", "restart")
        for suffix in ("a", "b") if elect else ("a",):
            replicas.append(start_replica(cp, ext_ns, f"gpu-extender-{suffix}", log_dir, leader_elect=elect,
                                          tree=tree, lease=lease))
        if not elect:  # one plain replica: label it as the election would, so the proxy finds it
            cp.patch(f"/api/v1/namespaces/{ext_ns}/pods/{replicas[0].name}", {"metadata": {"labels": {ROLE: "leader"}}})
            leader = replicas[0].name
        else:
            leader = wait_leader(cp, ext_ns, replicas, 60)
        result.old_leader = leader
        proxy, proxy_port = start_proxy(cp, ext_ns, log_dir, keep_connections)
        sched = cp.start_scheduler([extender_stanza(f"http://127.0.0.1:{proxy_port}")], qps=qps, burst=burst,
                                   name=f"kube-scheduler-{run_id}")
        watch.start()
        time.sleep(1.0)  # the proxy's first endpoint poll and the scheduler's informers
        started = time.time()
        client = cp.api()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client.post, f"/api/v1/namespaces/{pod_ns}/pods", json={
                "metadata": {"name": f"p-{i:03d}", "labels": {"bench": "failover"}},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/none:0",
                                         "resources": {"limits": {GPU: str(n)}, "requests": {GPU: str(n)}}}],
                         "terminationGracePeriodSeconds": 0,
                         **({"schedulingGates": [{"name": HOLD}]} if i >= len(sizes) - gated else {})}})
                for i, n in enumerate(sizes)]
            bad = [f.result() for f in futures if f.result().status_code != 201]
        if bad:
            raise RuntimeError(f"creating pods: {bad[0].status_code} {bad[0].text[:300]}")
        deadline = time.monotonic() + timeout
        kill_time = 0.0
        if kill != "none":
            tail = LogCount(sched.log, "Successfully bound pod to node")
            while max(len(watch.bound), tail.count()) < kill_after and time.monotonic() < deadline:
                time.sleep(0.01)
            victim = next(r for r in replicas if r.name == leader)
            kill_time = time.time()

            def kill_and_replace() -> None:  # the kubelet restarts the container, or the Deployment replaces it
                kill_replica(victim, kill)
                replicas.append(start_replica(cp, ext_ns, victim.name, log_dir, leader_elect=elect, tree=tree,
                                              log_name=f"{victim.name}-again", lease=lease))

            replaced.append(threading.Thread(target=kill_and_replace, daemon=True))
            replaced[0].start()
            for i in range(len(sizes) - gated, len(sizes)):
                cp.patch(f"/api/v1/namespaces/{pod_ns}/pods/p-{i:03d}",
                         [{"op": "remove", "path": "/spec/schedulingGates"}], kind="json")
            if elect:
                new = wait_leader(cp, ext_ns, replicas, 60, not_=leader)
                result.kill_to_new_leader_s = time.time() - kill_time
                result.new_leader = new
            else:
                replaced[0].join(90)
                result.kill_to_new_leader_s = time.time() - kill_time  # here: back, serving its Pod's port
                result.new_leader = leader
        while len(watch.bound) < pods and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the scheduler's log lines of the last binds
        finished = {n for n, t in watch.bound.items()}
        result.pending = pods - len(finished)
        result.attempts = {res: sched.metric("scheduler_schedule_attempts_total", result=res)
                           for res in ("scheduled", "error", "unschedulable")}
        log_binds = scheduler_binds(sched.log, pod_ns)
        # A pod the dying leader bound while kube-scheduler's call to it failed has no bind line (the scheduler
        # counted an error): its time is the watch's.
        result.bound_without_log_line = sorted(set(watch.bound) - set(log_binds))
        times = sorted({**watch.bound, **log_binds}.values())
        result.series = [round(t - started, 4) for t in times]
        if times:
            result.all_bound_s = round(times[-1] - started, 3) if not result.pending else float("nan")
        deltas = sorted(abs(watch.bound[n] - t) * 1000 for n, t in log_binds.items() if n in watch.bound)
        result.watch_vs_log_p50_ms = round(deltas[len(deltas) // 2], 1) if deltas else float("nan")
        if kill != "none" and times:
            before = [t for t in times if t <= kill_time]
            after = [t for t in times if t > kill_time]
            result.kill_at = round(kill_time - started, 4)
            result.binds_before_kill = len(before)
            if len(before) > 1:
                result.rate_before = round((len(before) - 1) / (before[-1] - before[0]), 1)
            if before and after:
                result.gap_s = round(after[0] - before[-1], 3)
                result.kill_to_first_bind_s = round(after[0] - kill_time, 3)
                seq = [before[-1], *after]
                result.longest_pause_after_kill_s = round(max(b - a for a, b in itertools.pairwise(seq)), 3)
        elif times and len(times) > 1:
            result.rate_before = round((len(times) - 1) / (times[-1] - times[0]), 1)
        proof = prove_no_double_allocation(cp, pod_ns, allocatable)
        result.proof = {**asdict(proof), "ok": proof.ok}
        if kill.startswith("sigterm"):
            result.written_after_release = binds_after_release(log_dir / f"{leader}.log")
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        watch.stop()
        if sched is not None:
            cp.stop_scheduler(sched)
        for t in replaced:  # a replacement still starting is stopped with the others
            t.join(90)
        for r in replicas:
            r.proc.stop(30)
        if proxy is not None:
            proxy.stop()
            result.proxy_changes = [line.strip() for line in proxy.log_tail(20000).splitlines() if "endpoints" in line]
        # Pods on nodes without a kubelet only go away when forced; the next run starts from empty nodes.
        cp.request("DELETE", f"/api/v1/namespaces/{pod_ns}/pods", gracePeriodSeconds=0)
    return result


def binds_after_release(log: Path) -> int:
    """The Bindings a replica wrote (`kube.pod.bound`, in its JSON log) after its last `kube.election.released`:
    each could meet a plan the new leader made on the same GPUs without knowing it, so it must be 0."""
    count, released = 0, False
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "kube.election.released"' in line:
            count, released = 0, True
        elif released and '"event": "kube.pod.bound"' in line:
            count += 1
    return count


def sweep_counts(pods: int, k: int) -> list[int]:
    """K distinct bind counts from the first bind to a few pods before the burst's end."""
    last = max(1, pods - 5)
    return sorted({max(1, round(1 + i * (last - 1) / max(1, k - 1))) for i in range(k)})


def kill_desc(counts: Sequence[int]) -> str:
    distinct = sorted(set(counts))
    if len(distinct) == 1:
        return str(distinct[0])
    return f"{len(distinct)} different counts ({distinct[0]}-{distinct[-1]})"


# -- report ------------------------------------------------------------------------------------------------------


def summary(results: Sequence[RunResult]) -> str:
    """Per kill kind, over the runs whose kill landed mid-burst (binds on both sides of it): how long binds paused
    (the longest gap between binds from the last one before the kill on, p50 / p99 / max), the time from the kill to
    the first bind after it, GPUs given twice, pods never bound and kube-scheduler's failed attempts, over every
    run of that kind."""
    rows = []
    for kind in sorted({r.kill for r in results}):
        runs = [r for r in results if r.kill == kind]
        landed = [r for r in runs if r.binds_before_kill and r.series and r.series[-1] > r.kill_at]
        pauses = [r.longest_pause_after_kill_s for r in landed]
        firsts = [r.kill_to_first_bind_s for r in landed]
        rows.append([kind, len(runs), len(landed),
                     *(round(percentile(pauses, q), 3) if pauses else "-" for q in (50, 99)), max(pauses, default="-"),
                     round(percentile(firsts, 50), 3) if firsts else "-",
                     sum(len(r.proof.get("given_twice", [])) for r in runs), sum(r.pending for r in runs),
                     sum(int(r.attempts.get("error", 0)) for r in runs),
                     f"{min(r.load_before[0] for r in runs):.1f}-{max(r.load_before[0] for r in runs):.1f}"])
    return markdown_table(["kill", "runs", "runs with binds on both sides of the kill", "pause p50 s", "pause p99 s",
                           "pause max s", "kill → first bind p50 s", "GPUs given twice", "pods never bound",
                           "attempts error", "load1"], rows)


def table(results: Sequence[RunResult]) -> str:
    rows = []
    for r in results:
        p = r.proof
        rows.append([r.kill, r.run, f"{r.load_before[0]:.2f}", r.binds_before_kill, r.rate_before, r.gap_s,
                     r.longest_pause_after_kill_s, r.kill_to_new_leader_s and round(r.kill_to_new_leader_s, 2),
                     r.all_bound_s, r.pending, int(r.attempts.get("error", 0)),
                     int(r.attempts.get("unschedulable", 0)), p.get("bound"), p.get("gpus_planned"),
                     len(p.get("given_twice", [])), len(p.get("over_allocatable", [])),
                     len(p.get("missing_plan", [])) + len(p.get("wrong_node", [])) + len(p.get("wrong_count", [])),
                     len(r.bound_without_log_line), r.written_after_release if r.kill.startswith("sigterm") else "-"])
    return markdown_table(["kill", "run", "load1", "binds before kill", "binds/s before",
                           "gap s (last bind before kill → first after)",
                           "longest pause s", "kill→new leader s", "all bound s", "pending", "attempts error",
                           "attempts unschedulable", "pods bound", "GPUs planned", "GPUs given twice",
                           "nodes over allocatable", "plan problems", "bound, scheduler saw error",
                           "binds written after the Lease was released"], rows)


def plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r.kill for r in results})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for r in (r for r in results if r.kill == kind):
            line, = ax.plot(r.series, range(1, len(r.series) + 1), drawstyle="steps-post", label=f"run {r.run}")
            if r.kill_at:
                ax.axvline(r.kill_at, color=line.get_color(), linestyle="--", linewidth=1)
        ax.set_title(f"leader killed with {kind.upper()} (dashed: the kill)", fontsize=10)
        ax.set_xlabel("seconds since the burst was created")
        ax.set_ylabel("pods bound (kube-scheduler log, else watch)")
        ax.grid(alpha=0.3)
        if sum(1 for r in results if r.kill == kind) <= 6:  # a sweep's many runs: the lines speak alone
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--kill", choices=(*KILLS, "both", "all", "none"), default="both",
                        help="both: sigterm and sigkill; all: every kind")
    parser.add_argument("--nodes", type=int, default=0, help="GPU nodes (0: enough for the burst to use ~2/3)")
    parser.add_argument("--runs", type=int, default=3, help="runs per kill variant")
    parser.add_argument("--kill-after", type=int, default=0, help="binds before the kill (0: a third of --pods)")
    parser.add_argument("--sweep", type=int, default=0,
                        help="K runs per kind, killing after K different bind counts spread over the burst "
                             "(instead of --runs at --kill-after)")
    parser.add_argument("--burners", type=int, default=0, help="processes burning CPU throughout")
    parser.add_argument("--lease", default="15,10,2",
                        help="the replicas' lease duration, renew deadline and retry period, seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--qps", type=float, default=50, help="kube-scheduler clientConnection qps (burst: 2x)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a run may take to bind every pod")
    parser.add_argument("--out", type=Path, default=RESULTS / "failover")
    parser.add_argument("--proxy", choices=("close", "keep"), default="close",
                        help="the Service stand-in: close connections to a replica that left the endpoints, or keep "
                             "them as kube-proxy's conntrack does")
    parser.add_argument("--extender-tree", type=Path, default=ROOT,
                        help="run the replicas from this checkout (e.g. a git worktree of an older commit, to "
                             "compare old and new on the same machine)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy the run logs to this directory")
    opts = parser.parse_args(argv)
    from tests.helpers.controlplane import ControlPlane, skip_reason

    reason = skip_reason()
    if reason:
        print(f"bench.failover: skipped: {reason}", file=sys.stderr)
        raise SystemExit(2)
    kinds = {"both": ["sigterm", "sigkill"], "all": list(KILLS), "none": ["none"]}.get(opts.kill, [opts.kill])
    sizes = burst_sizes(opts.pods, opts.seed)
    nodes = opts.nodes or default_nodes(opts.pods, opts.seed)
    kill_after = opts.kill_after or max(1, opts.pods // 3)
    lease_parts = [int(x) for x in opts.lease.split(",")]
    if len(lease_parts) != 3:
        parser.error("--lease takes three numbers: duration,renew deadline,retry period")
    lease = (lease_parts[0], lease_parts[1], lease_parts[2])
    # the sweep's bind counts: spread from the first bind to near the burst's end, shuffled so that a drift of the
    # machine over the sweep does not line up with k
    counts = [kill_after] * opts.runs if not opts.sweep else \
        random.Random(opts.seed).sample(sweep_counts(opts.pods, opts.sweep), opts.sweep)
    results: list[RunResult] = []
    failure = ""
    try:
        with ControlPlane() as cp, burning(opts.burners):
            log_dir = cp.dir / "logs"
            log_dir.mkdir()
            t0 = time.monotonic()
            allocatable = add_nodes(cp, nodes)
            print(f"control plane at {cp.url}; {nodes} GPU nodes ({sum(allocatable.values())} GPUs) in "
                  f"{time.monotonic() - t0:.1f} s; burst {opts.pods} pods asking {sum(sizes)} GPUs "
                  f"({Counter(sizes)}); kill after {sorted(set(counts))} binds; {opts.burners} CPU burners",
                  flush=True)
            try:
                for n, k in enumerate(counts, 1):
                    for kind in kinds:  # kinds alternate, so that each meets the same machine
                        print(f"{machine_line()}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
                        r = run_once(cp, run_id=f"{kind}-{n}", kill=kind, pods=opts.pods, sizes=sizes,
                                     allocatable=allocatable, kill_after=k, log_dir=log_dir,
                                     timeout=opts.timeout, qps=opts.qps, burst=int(2 * opts.qps), run_no=n,
                                     keep_connections=opts.proxy == "keep", tree=opts.extender_tree,
                                     lease=lease)
                        results.append(r)
                        print(f"{kind} run {n}: {r.binds_before_kill} binds before the kill at {r.rate_before}/s, "
                              f"gap {r.gap_s} s (longest pause {r.longest_pause_after_kill_s} s), new leader "
                              f"{r.new_leader} after {r.kill_to_new_leader_s:.2f} s, all bound at {r.all_bound_s} s, "
                              f"pending {r.pending}, attempts {r.attempts}, bound {r.proof['bound']}, "
                              f"GPUs given twice {len(r.proof['given_twice'])}, proof ok {r.proof['ok']}", flush=True)
                        if not r.proof["ok"]:
                            print(f"PROOF FAILED: {json.dumps(r.proof)[:2000]}", flush=True)
            finally:
                keep_logs(opts.keep_logs, log_dir, cp.dir)
    except RuntimeError as e:  # a component that would not start or serve: one line, then what was measured
        failure = str(e)
        print(f"bench.failover: failed: {failure.splitlines()[0]}", file=sys.stderr)
    if not results:
        raise SystemExit(1)
    md = summary(results) + "\n\n" + table(results)
    print(machine_line())
    print(md)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.failover " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"# Extender failover (real kube-apiserver + kube-scheduler v1.36.2)\n\n`{command}`\n\n{machine_line()}; "
              f"{nodes} GPU nodes, {sum(allocatable.values())} GPUs; {opts.pods} pods asking {sum(sizes)} GPUs; "
              f"leader killed after {kill_desc(counts)} binds; {opts.burners} CPU burners; Lease {opts.lease} s; "
              f"kube-scheduler qps {opts.qps} burst {int(2 * opts.qps)}; "
              f"Service stand-in: {opts.proxy} connections to a replica that leaves the endpoints.\n\n")
    opts.out.with_suffix(".md").write_text(header + md + "\n")
    opts.out.with_suffix(".json").write_text(json.dumps({
        "command": command, "machine": machine_line(), "nodes": nodes, "gpus": sum(allocatable.values()),
        "pods": opts.pods, "gpus_asked": sum(sizes), "kill_after": counts, "burners": opts.burners,
        "proxy": opts.proxy,
        "runs": [asdict(r) for r in results]}, indent=1, default=str))
    plot(results, opts.out.with_suffix(".png"))
    print(f"wrote {opts.out.with_suffix('.md')}, .json, .png")
    if failure or any(not r.proof.get("ok") or r.pending for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Property: whatever mix of single pods and job pods kube-scheduler schedules, binds elsewhere, finishes or lets
time out, through the verbs over HTTP (standalone extender), no GPU is ever assigned twice and no single pod is ever
planned onto a slot a job holds; a job pod that binds where its job has a slot takes exactly one slot."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.service import Extender
from extender.state.reservations import JOB
from gputopo.core.bitset import mask_of
from sim.scheduler import gpu_pod
from tests.extender.conftest import running
from tests.extender.jobs.conftest import DGX_A100, PREFIX, RACK
from tests.helpers.scheduler import bind_body, cache_args

NODES = ["a0", "a1", "b0", "b1"]
TIMEOUT_S = 60.0

jobs_st = st.lists(st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 4])), min_size=1, max_size=3)
op_st = st.one_of(
    st.tuples(st.just("single"), st.sampled_from([1, 2, 4, 8])),
    st.tuples(st.just("job"), st.integers(0, 2)),
    st.tuples(st.just("stray"), st.integers(0, 2), st.sampled_from(NODES)),
    st.tuples(st.just("finish"), st.integers(0, 40)),
    st.tuples(st.just("expire")),
)


class World:
    def __init__(self, ext: Extender, client: httpx.Client, jobs: list[tuple[int, int]], now: list[float]) -> None:
        self.ext, self.client, self.now = ext, client, now
        self.jobs = jobs
        self.next_index = [0] * len(jobs)
        self.bound: list[str] = []  # uids, oldest first
        self.job_of: dict[str, int] = {}

    def slots(self) -> dict[str, list[tuple[str, int]]]:
        """node -> (job key of the slot, GPU mask) of every job slot reserved now."""
        out: dict[str, list[tuple[str, int]]] = {}
        for r in self.ext.reservations.all():
            if r.source == JOB:
                out.setdefault(r.node, []).append((r.uid.split("#")[0].removeprefix("job:"), r.mask))
        return out

    def pod(self, op: tuple[Any, ...]) -> tuple[dict[str, Any], int | None]:
        if op[0] == "single":
            return gpu_pod(f"single-{uuid.uuid4().hex[:8]}", op[1]), None
        j = op[1] % len(self.jobs)
        pods, gpus = self.jobs[j]
        index = self.next_index[j]
        self.next_index[j] += 1
        ann = {f"{PREFIX}/job": f"job-{j}", f"{PREFIX}/job-size": str(pods)}
        return gpu_pod(f"job-{j}-{index}", gpus, annotations=ann), j

    def schedule(self, op: tuple[Any, ...]) -> None:
        pod, j = self.pod(op)
        out = self.client.post("/filter", json=cache_args(pod, NODES)).json()
        passed = out["NodeNames"]
        if op[0] == "stray":
            node = op[2]  # bound where the scheduler chose, whatever the filter said (a stale cycle, a retry)
        elif not passed:
            return
        else:
            scores = self.client.post("/prioritize", json=cache_args(pod, passed)).json()
            node = max(scores, key=lambda h: (h["Score"], h["Host"]))["Host"]
        before = self.slots().get(node, [])
        if self.client.post("/bind", json=bind_body(pod, node)).json()["Error"]:
            return
        uid = pod["metadata"]["uid"]
        self.bound.append(uid)
        plan = self.ext.cache.pods[uid].plan
        assert plan is not None
        mask = mask_of(self.ext.cache.nodes[node].index[i] for i in plan.ids)
        mine = [m for key, m in before if j is not None and key == f"default/annotation/job-{j}"]
        others = [m for key, m in before if j is None or key != f"default/annotation/job-{j}"]
        assert not any(mask & m for m in others), f"{pod['metadata']['name']} was planned onto another job's slot"
        if mine:
            assert mask in mine, f"{pod['metadata']['name']} did not take exactly one of its job's slots"

    def finish(self, k: int) -> None:
        if self.bound:
            uid = self.bound.pop(k % len(self.bound))
            assert self.client.delete(f"/inventory/pods/{uid}").status_code == 200

    def expire(self) -> None:
        self.now[0] += TIMEOUT_S + 1
        self.ext.cache.expire_reservations()

    def check(self) -> None:
        """No GPU twice: bound plans disjoint and inside the used GPUs; slots disjoint from each other and unused."""
        inventory = self.client.get("/inventory").json()
        used: dict[str, set[str]] = {}
        for p in inventory["pods"]:
            ids = set(next(iter(p["plan"]["containers"].values())))
            assert not used.get(p["node"], set()) & ids, f"GPUs {used[p['node']] & ids} on {p['node']} twice"
            used.setdefault(p["node"], set()).update(ids)
        for node in inventory["nodes"]:
            assert used.get(node["name"], set()) == set(node["used"])
        for node, held in self.slots().items():
            entry = self.ext.cache.nodes[node]
            total = 0
            for _, m in held:
                assert not m & total, f"two slots share GPUs on {node}"
                assert not m & entry.used_mask, f"a slot on {node} holds GPUs in use"
                total |= m


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=jobs_st, ops=st.lists(op_st, min_size=5, max_size=30))
def test_no_gpu_is_assigned_twice_and_single_pods_never_take_job_slots(tmp_path: Path, jobs: list[tuple[int, int]],
                                                                      ops: list[tuple[Any, ...]]) -> None:
    inventory = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}.yaml"
    inventory.write_text(yaml.safe_dump({"nodes": [
        {"name": n, "topology": str(DGX_A100), "labels": {RACK: n[0]}} for n in NODES]}))
    now = [0.0]
    ext = Extender.standalone(inventory, ExtenderConfig(reservation_timeout_s=TIMEOUT_S), clock=lambda: now[0],
                              expiry_interval_s=3600)
    with running(ext) as client:
        world = World(ext, client, jobs, now)
        for op in ops:
            if op[0] in ("single", "job", "stray"):
                world.schedule(op)
            elif op[0] == "finish":
                world.finish(op[1])
            else:
                world.expire()
            world.check()

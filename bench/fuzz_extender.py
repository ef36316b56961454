"""Scheduler extender fuzzing at scale: `python -m bench.fuzz_extender [--cases 2000] [--storm 3000] [--seed 1]`,
written to bench/results/fuzz-extender.md.

The extender runs as its own process (`gpu-extender serve --inventory`, standalone mode, plain HTTP on 127.0.0.1,
the default 10 MiB body limit, warning-level logs counted, not shown). Three phases, all seeded:

1. schemathesis from the extender's published OpenAPI schema: `--cases` hypothesis-made requests per verb and
   generation mode (positive: bodies that keep the schema, negative: bodies that break it), each judged by
   schemathesis' own checks (status code, content type and body conformance, negative data rejected, positive
   accepted) and by the oracle below.
2. The hand-made catalogue of tests/reliability/test_extender_fuzz.py in full: 20 MiB bodies (sized and chunked),
   10,000 levels of nesting, non-UTF-8, lone surrogates, NaN/Infinity, duplicated keys, huge integers, 100,000
   nodes, broken HTTP framing, and every field of every recorded kube-scheduler body replaced by each of 16 wrong
   values (null, each JSON type, edge numbers, hostile strings).
3. A concurrent bind storm: `--storm` pods, 32 client threads, each doing filter on 3 random nodes of 100 then bind
   to the first that passed; afterwards every bound plan is read back (GET /inventory) and every (node, GPU) named
   by two live plans is a GPU assigned twice.

Oracle (check_answer in the test module): never a 5xx; a verb answers 200 with a body valid for it (pydantic models
of extender.http.models; prioritize scores exactly the nodes asked, filter partitions them), or 400/413 with an Error;
a 200 never carries the internal-error message. A crash is the process exiting or /healthz not answering "ok"
(checked every 250 cases; the server is restarted and the run goes on). The internal-error counter of /metrics must
stay at zero. Times are client-observed round trips on a shared 2-core machine (client and server compete).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import requests
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import Case, GenerationMode
from schemathesis.openapi import from_dict

from bench.common import RESULTS, ROOT, machine_line, markdown_table, percentile, stop_process
from tests.extender.conftest import A100, DGX1
from tests.helpers.scheduler import bind_body, cache_args, pod_json
from tests.reliability import test_extender_fuzz as fz

CHECK_EVERY = 250
STORM_NODES = 100
VERBS = fz.VERBS


class Slowest:
    """The slowest request so far, kept to be sent again: is it slow every time, or was the machine busy?"""

    request: fz.Nasty | None = None


class Server:
    """`gpu-extender serve --inventory` as a subprocess; restarted if it dies."""

    def __init__(self, inventory: Path, log: Path) -> None:
        self.inventory = inventory
        self.log = log
        self.crashes = 0
        self.internal_errors = 0.0
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start()

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "extender.cli", "serve", "--inventory", str(self.inventory), "--port", str(port),
             "--log-level", "warning"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.starts += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.healthy():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"gpu-extender did not start: {self.log.read_text()[-2000:]}")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=30).text == "ok"
        except httpx.HTTPError:
            return False

    def check(self) -> None:
        """A crash is the process gone or /healthz not answering; count it and start again."""
        assert self.proc is not None
        if self.proc.poll() is None and self.healthy():
            return
        self.crashes += 1
        print(f"  CRASH: extender exited with {self.proc.poll()}; restarting", flush=True)
        self.stop()
        self.start()

    def read_internal_errors(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(r'^gpu_extender_internal_errors_total\{[^}]*\} (\S+)$', text, re.M))

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(httpx.HTTPError):
            if self.proc.poll() is None:
                self.internal_errors += self.read_internal_errors()
        if self.proc.poll() is None:
            stop_process(self.proc, 30)
        self.proc = None


def write_inventory(path: Path) -> None:
    nodes = [{**n, "topology": str(n["topology"])} for n in fz.INVENTORY]
    nodes += [{"name": "storm-a100", "topology": str(A100), "replicas": STORM_NODES // 2},
              {"name": "storm-dgx", "topology": str(DGX1), "replicas": STORM_NODES // 2}]
    path.write_text(yaml.safe_dump({"nodes": nodes}))


def _request_bytes(case: Case) -> bytes:
    try:
        return json.dumps(case.body).encode()
    except (TypeError, ValueError):
        return b""


def _schemathesis_batch(server: Server, tally: fz.Tally, session: requests.Session, operation: Any, verb: str,
                        mode: GenerationMode, cases: int, run_seed: int) -> int:
    """`cases` requests of one verb and generation mode; broken promises are recorded, not raised."""
    sent = 0

    @seed(run_seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Case) -> None:
        nonlocal sent
        label = f"schemathesis {mode.value} /{verb} #{sent}"
        started = time.perf_counter()
        try:
            response = case.call(base_url=server.url, session=session, timeout=60)
        except requests.RequestException as e:
            tally.note(f"/{verb}", 0, time.perf_counter() - started, label, [f"no answer: {e}"])
            server.check()
            return
        seconds = time.perf_counter() - started
        problems = fz.check_answer(f"/{verb}", "POST", _request_bytes(case), response.status_code, response.content)
        try:
            case.validate_response(response)
        except Exception as e:  # schemathesis raises a group of failed checks
            problems.append(f"schemathesis: {str(e)[:300]}")
        tally.note(f"/{verb}", response.status_code, seconds, label, problems)
        if tally.slowest[1] == label:
            prepared = response.request
            body = prepared.body if isinstance(prepared.body, bytes) else (prepared.body or "").encode()
            Slowest.request = fz.Nasty(label, f"/{verb}", body, content_type=prepared.headers.get("Content-Type"))
        sent += 1
        if sent % CHECK_EVERY == 0:
            server.check()

    one()
    server.check()
    return sent


def run_schemathesis(server: Server, tally: fz.Tally, cases: int, run_seed: int) -> dict[tuple[str, str], int]:
    schema = from_dict(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
    done: dict[tuple[str, str], int] = {}
    with requests.Session() as session:
        for verb in VERBS:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                n = _schemathesis_batch(server, tally, session, schema[f"/{verb}"]["POST"], verb, mode, cases,
                                        run_seed)
                done[(verb, mode.value)] = n
                print(f"  schemathesis {mode.value:8} /{verb}: {n} cases", flush=True)
    return done


def run_nasties(server: Server, tally: fz.Tally, run_seed: int) -> int:
    sent = 0
    client = httpx.Client(base_url=server.url, timeout=120)
    try:
        for nasty in fz.nasties(random.Random(run_seed), mutations=None):
            try:
                fz.send(client, nasty, tally)
            except httpx.HTTPError as e:
                tally.note(nasty.path, 0, 0.0, nasty.label, [f"no answer: {e}"])
                server.check()
                client.close()
                client = httpx.Client(base_url=server.url, timeout=120)
            if tally.slowest[1] == nasty.label:
                Slowest.request = nasty
            sent += 1
            if sent % CHECK_EVERY == 0:
                server.check()
    finally:
        client.close()
    server.check()
    return sent


def server_side_max(server: Server) -> dict[str, str]:
    """Per verb, the bound of the extender's own latency histogram that holds all its requests so far ("<= 0.25 s"):
    the server's view, without the client and the network."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out: dict[str, str] = {}
    for verb in VERBS:
        buckets = [(float(le), float(n)) for le, n in re.findall(
            rf'^gpu_extender_request_seconds_bucket\{{le="([^"]+)",verb="{verb}"\}} (\S+)$', text, re.M)]
        total = max((n for _, n in buckets), default=0.0)
        bound = min((le for le, n in buckets if n >= total), default=float("inf"))
        out[f"/{verb}"] = f"<= {bound:g} s" if bound != float("inf") else "> 5 s"
    return out


def replay_slowest(server: Server, times: int = 3) -> list[float]:
    """Send the slowest request again on the same server; its round trips."""
    if Slowest.request is None:
        return []
    scratch = fz.Tally()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(times):
            fz.send(client, Slowest.request, scratch)
    return [t for ts in scratch.seconds.values() for t in ts]


def run_storm(server: Server, pods: int, run_seed: int) -> dict[str, Any]:
    rng = random.Random(run_seed)
    names = [f"storm-a100-{i}" for i in range(STORM_NODES // 2)] + [f"storm-dgx-{i}" for i in range(STORM_NODES // 2)]
    batch = [pod_json(f"storm-{i}", gpus=rng.choice([1, 1, 2, 4, 8])) for i in range(pods)]
    choices = [rng.sample(names, 3) for _ in batch]
    times: list[float] = []
    lock = threading.Lock()
    with httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:

        def one(k: int) -> str:
            started = time.perf_counter()
            ok = client.post("/filter", json=cache_args(batch[k], choices[k])).json()["NodeNames"]
            error = client.post("/bind", json=bind_body(batch[k], ok[0] if ok else choices[k][0])).json()["Error"]
            with lock:
                times.append(time.perf_counter() - started)
            return error

        started = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            errors = list(pool.map(one, range(pods)))
        wall = time.perf_counter() - started
        inventory = client.get("/inventory").json()
    storm_uids = {p["metadata"]["uid"] for p in batch}
    taken: Counter[tuple[str, str]] = Counter()
    for p in inventory["pods"]:
        for ids in p["plan"]["containers"].values():
            taken.update((p["node"], g) for g in ids)
    twice = sum(1 for n in taken.values() if n > 1)
    used = {(n["name"], g) for n in inventory["nodes"] if n["name"].startswith("storm-") for g in n["used"]}
    storm_plans = {(p["node"], g) for p in inventory["pods"] if p["uid"] in storm_uids
                   for ids in p["plan"]["containers"].values() for g in ids}
    storm_gpus = sum(n["gpus"] for n in inventory["nodes"] if n["name"].startswith("storm-"))
    return {"pods": pods, "bound": errors.count(""), "gpus_planned": len(storm_plans), "gpus": storm_gpus,
            "refused": sum(1 for e in errors if e),
            "other_errors": sum(1 for e in errors if e and "cannot take pod" not in e),
            "twice": twice, "plans_match_inventory": used == storm_plans, "wall": wall,
            "p50": percentile(times, 50), "p99": percentile(times, 99), "max": max(times)}


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def report(args: argparse.Namespace, tally: fz.Tally, schema_done: dict[tuple[str, str], int], nasties: int,
           storm: dict[str, Any], server: Server, wall: float, log_lines: int, load: tuple[Any, Any],
           replayed: list[float], server_max: dict[str, str]) -> str:
    per_endpoint = sorted({e for e, _ in tally.statuses})
    rows = []
    for e in per_endpoint:
        codes = sorted(((s, n) for (ep, s), n in tally.statuses.items() if ep == e), key=lambda x: -x[1])
        t = tally.seconds.get(e, [])
        slow = tally.slowest_by_endpoint.get(e, (0.0, ""))
        rows.append([e, sum(n for _, n in codes), ", ".join(f"{s or 'none'}: {n}" for s, n in codes),
                     _ms(percentile(t, 50)), _ms(percentile(t, 99)), f"{_ms(slow[0])} ({slow[1][:70]})",
                     server_max.get(e, "")])
    five = tally.server_errors
    lines = [
        "# Scheduler extender fuzzing",
        "",
        f"`python -m bench.fuzz_extender --cases {args.cases} --storm {args.storm} --seed {args.seed}` on "
        f"{machine_line()}; {wall:.0f} s wall. The extender is a `gpu-extender serve --inventory` process on "
        "127.0.0.1 (standalone mode, default 10 MiB body limit); the fuzzer is another process on the same machine, "
        f"so times include the client's cost and other load (load average 1/5/15 min, start -> end: "
        f"{load[0][0]:.1f} -> {load[1][0]:.1f}, {load[0][1]:.1f} -> {load[1][1]:.1f}, "
        f"{load[0][2]:.1f} -> {load[1][2]:.1f}).",
        "",
        "Oracle: no 5xx ever; a verb answers 200 with a body valid for it (extender.http.models; prioritize "
        "scores exactly the nodes asked, filter partitions them) or 400/413 with an Error; a 200 never carries the "
        "internal-error message, and the internal-error counter stays at 0; schemathesis' own checks on its cases. "
        f"A crash is the process gone or /healthz not answering (checked every {CHECK_EVERY} cases).",
        "",
        "## Totals",
        "",
        markdown_table(
            ["cases", "5xx responses", "crashes", "internal errors", "broken promises", "longest request",
             "GPUs assigned twice (storm)"],
            [[tally.cases, five, server.crashes, int(server.internal_errors), len(tally.problems),
              f"{_ms(tally.slowest[0])} ms ({tally.slowest[1][:80]})", storm["twice"]]]),
        "",
        "Targets: 0 5xx, 0 crashes, 0 GPUs assigned twice. Extender log output during the run: "
        f"{log_lines} lines (warning level). The longest request sent again {len(replayed)} times after the fuzzing "
        f"phases, same server: {', '.join(_ms(t) for t in replayed)} ms "
        f"({len(Slowest.request.body) if Slowest.request else 0} bytes).",
        "",
        "## Cases by source",
        "",
        markdown_table(["source", "cases"],
                       [[f"schemathesis {mode} /{verb}", n] for (verb, mode), n in schema_done.items()]
                       + [["hand-made catalogue (incl. every field x 16 wrong values)", nasties]]),
        "",
        "## Status codes and times per endpoint (fuzzing phases, sequential)",
        "",
        "`none`: the connection closed without an answer (raw requests that cut their own body short). Times are "
        "client round trips; the last column is the extender's own `gpu_extender_request_seconds` histogram (body "
        "read to answer built), read after these phases: the smallest bucket holding every request of the verb.",
        "",
        markdown_table(["endpoint", "requests", "status codes", "p50 ms", "p99 ms", "longest ms (request)",
                        "server-side longest (histogram)"], rows),
        "",
        "## Concurrent bind storm",
        "",
        f"{storm['pods']} pods (1, 1, 2, 4 or 8 GPUs), 32 client threads, {STORM_NODES} nodes (8-GPU A100 NVSwitch "
        "and DGX-1 V100); each pod: filter on 3 random nodes, bind to the first that passed.",
        "",
        markdown_table(
            ["pods", "bound", "refused (no fit)", "other errors", "GPUs planned", "GPUs assigned twice",
             "plans = inventory used", "pods/s", "filter+bind p50 ms", "p99 ms", "max ms"],
            [[storm["pods"], storm["bound"], storm["refused"], storm["other_errors"],
              f"{storm['gpus_planned']} of {storm['gpus']}", storm["twice"],
              storm["plans_match_inventory"], f"{storm['pods'] / storm['wall']:.0f}", _ms(storm["p50"]),
              _ms(storm["p99"]), _ms(storm["max"])]]),
        "",
    ]
    if tally.problems:
        lines += ["## Broken promises (first 20)", "", *[f"- {p[:300]}" for p in tally.problems[:20]], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="schemathesis cases per verb and generation mode")
    parser.add_argument("--storm", type=int, default=3000, help="pods in the concurrent bind storm")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz-extender.md")
    args = parser.parse_args()
    load_start = os.getloadavg()
    started = time.perf_counter()
    tally = fz.Tally()
    with tempfile.TemporaryDirectory(prefix="fuzz-extender-") as tmp:
        inv, log = Path(tmp) / "inventory.yaml", Path(tmp) / "extender.log"
        write_inventory(inv)
        server = Server(inv, log)
        try:
            print("schemathesis ...", flush=True)
            schema_done = run_schemathesis(server, tally, args.cases, args.seed)
            print("hand-made catalogue ...", flush=True)
            nasties = run_nasties(server, tally, args.seed)
            print(f"  {nasties} cases", flush=True)
            server_max = server_side_max(server)
            replayed = replay_slowest(server)
            print("bind storm ...", flush=True)
            storm = run_storm(server, args.storm, args.seed)
        finally:
            server.stop()
        log_lines = sum(1 for _ in log.open("rb"))
    wall = time.perf_counter() - started
    text = report(args, tally, schema_done, nasties, storm, server, wall, log_lines, (load_start, os.getloadavg()),
                  replayed, server_max)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""bench/train.py's pure parts, without torch or GPUs: the estimate, the per-rank environments, the host-path figure,
NCCL transport parsing, size planning and the report."""

from __future__ import annotations

import math

import pytest

from bench.nccl import SAFE_ENV
from bench.train import (
    BASELINE,
    CONFIG_BY_KEY,
    estimate_busbw,
    host_path_gbps,
    parse_transports,
    plan_sizes,
    rank_device,
    rank_env,
    render_markdown,
    throughput_estimate,
)
from gputopo.core import allreduce_gbps
from gputopo.discovery.loader import load_topology_file
from tests.helpers.paths import REPO

DATA = REPO / "gputopo" / "data"


def test_estimate_is_bracketed_by_no_overlap_and_full_overlap() -> None:
    # 256 images per GPU at 2560 images/s: 0.1 s of compute; 1 GB of gradients at 10 GB/s bus bandwidth on 2 GPUs:
    # 1e9 x 2(1)/2 / 1e10 = 0.1 s of all-reduce.
    lo, hi = throughput_estimate(2560.0, 256, 2, 1_000_000_000, 10.0)
    assert lo == pytest.approx(2 * 256 / 0.2)
    assert hi == pytest.approx(2 * 256 / 0.1)
    # communication longer than compute: full overlap is bounded by the all-reduce
    lo, hi = throughput_estimate(2560.0, 256, 2, 4_000_000_000, 10.0)
    assert lo == pytest.approx(2 * 256 / 0.5)
    assert hi == pytest.approx(2 * 256 / 0.4)


def test_estimate_at_one_gpu_is_the_baseline_and_faster_links_never_estimate_less() -> None:
    assert throughput_estimate(1000.0, 64, 1, 10**9, 0.0) == (1000.0, 1000.0)
    slow = throughput_estimate(1000.0, 64, 8, 10**9, 24.0)
    fast = throughput_estimate(1000.0, 64, 8, 10**9, 370.8)
    assert slow[0] < fast[0] <= 8000.0 and slow[1] <= fast[1] <= 8000.0
    assert all(math.isnan(x) for x in throughput_estimate(0.0, 64, 2, 10**9, 24.0))


def test_rank_environments_match_what_each_configuration_means() -> None:
    caller = {"PATH": "/bin", "NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "7", "NCCL_HOSTID": "x"}
    gpus = [2, 5]
    one_pod = rank_env(caller, CONFIG_BY_KEY["nvlink"], gpus, 1)
    assert one_pod["CUDA_VISIBLE_DEVICES"] == "2,5" and rank_device(CONFIG_BY_KEY["nvlink"], 1) == 1
    assert "NCCL_P2P_DISABLE" not in one_pod and "NCCL_HOSTID" not in one_pod  # nothing leaks from the caller
    assert rank_env(caller, CONFIG_BY_KEY["host"], gpus, 0)["NCCL_P2P_DISABLE"] == "1"
    pod = rank_env(caller, CONFIG_BY_KEY["pods"], gpus, 1)
    assert pod["CUDA_VISIBLE_DEVICES"] == "5" and rank_device(CONFIG_BY_KEY["pods"], 1) == 0
    net = [rank_env(caller, CONFIG_BY_KEY["pods-net"], gpus, r) for r in (0, 1)]
    assert net[0]["NCCL_HOSTID"] != net[1]["NCCL_HOSTID"]
    for env in (one_pod, pod, *net):
        assert env["PATH"] == "/bin" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert {k: env[k] for k in SAFE_ENV} == SAFE_ENV  # NVLink multicast off in every process


def test_host_path_figure_replaces_nvlink_with_pcie() -> None:
    topo = load_topology_file(DATA / "dgx1-v100-hybrid-cube-mesh.txt")  # V100: PCIe Gen3, x16 = 12 GB/s
    pair = [0, 3]
    assert topo.link(0, 3).kind.is_nvlink
    assert host_path_gbps(topo, pair) == pytest.approx(12.0)
    assert allreduce_gbps(topo, pair) > host_path_gbps(topo, pair)
    assert estimate_busbw(topo, CONFIG_BY_KEY["nvlink"], pair) == allreduce_gbps(topo, pair)
    assert estimate_busbw(topo, CONFIG_BY_KEY["pods"], pair) == host_path_gbps(topo, pair)
    assert estimate_busbw(topo, BASELINE, [0]) == 0.0
    pcie = load_topology_file(DATA / "pcie-8x-rtx5090-2socket.txt")  # no NVLink: the PCIe estimate as it is
    assert host_path_gbps(pcie, [0, 1]) == pytest.approx(allreduce_gbps(pcie, [0, 1]))


def test_transports_are_read_from_nccl_channel_lines() -> None:
    log = "\n".join([
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "h:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "h:1:2 [1] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0",
        "h:1:2 [1] NCCL INFO Channel 00 : 1[1c000] -> 0[1b000] via SHM/direct/direct",
        "h:1:2 [0] NCCL INFO Connected all rings",
    ])
    assert parse_transports(log) == ["NET/Socket/0", "P2P/CUMEM/read", "SHM/direct/direct"]
    assert parse_transports("") == []


def test_sizes_above_the_gpu_count_are_reported_not_dropped() -> None:
    assert plan_sizes([1, 2, 4, 8, 2], 4) == ([1, 2, 4], ["N=8: this machine has 4 GPUs"])
    assert plan_sizes([2], 1) == ([], ["N=2: this machine has 1 GPU"])
    with pytest.raises(ValueError):
        plan_sizes([0], 8)


def _result(items_per_s: float, ddp: bool = True) -> dict:
    result = {"unit": "images", "items_per_gpu_step": 256, "grad_bytes": 100_000_000, "items_per_s": items_per_s,
              "loss_finite": True, "step_ms_median": 100.0, "step_ms_p90": 101.0}
    if ddp:
        result.update(grad_rank_diff=0.0, grad_mean_err=1e-5, param_rank_diff=0.0)
    return result


def test_report_puts_scaling_efficiency_and_estimate_beside_each_measurement() -> None:
    data = {
        "machine": "2x test GPU", "command": "python -m bench.train --sizes 2", "torch": "t", "nccl": "n",
        "args": {"warmup": 10, "iters": 30, "nccl_iters": 20},
        "models": {"resnet50": {"unit": "images", "describe": "test"}},
        "runs": [
            {"model": "resnet50", "config": "baseline", "size": 1, "gpus": [0], "transports": [],
             "estimate_busbw_gbps": 0.0, "result": _result(1000.0, ddp=False)},
            {"model": "resnet50", "config": "nvlink", "size": 2, "gpus": [0, 1], "transports": ["P2P/CUMEM/read"],
             "estimate_busbw_gbps": 100.0, "result": _result(1900.0)},
            {"model": "resnet50", "config": "pods", "size": 2, "gpus": [0, 1], "transports": ["SHM/direct/direct"],
             "estimate_busbw_gbps": 1.0, "result": {**_result(600.0), "grad_rank_diff": 0.5}},
        ],
        "allreduce": [{"config": "pods", "size": 2, "gpus": [0, 1], "transports": ["SHM/direct/direct"],
                       "mib": [1, 4], "estimate_busbw_gbps": 24.0,
                       "results": [{"busbw": 10.0, "correct": True}, {"busbw": 20.0, "correct": True}]}],
        "skipped": ["N=4: this machine has 2 GPUs"],
    }
    md = render_markdown(data, "test")
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| ")}
    nvlink = rows["one pod of N GPUs (allocator's subset)"]
    assert "| 1,900 | 0.950 |" in nvlink  # 1900 / (2 x 1000)
    lo, hi = throughput_estimate(1000.0, 256, 2, 100_000_000, 100.0)
    assert f"{lo:,.0f} .. {hi:,.0f}" in nvlink and "P2P/CUMEM/read" in nvlink
    assert "FAILED" in rows["N pods (CUDA_VISIBLE_DEVICES = own GPU)"]  # ranks disagreeing is not hidden
    assert "| 10.0 | 20.0 | 24.0 | yes |" in md
    assert "- N=4: this machine has 2 GPUs" in md

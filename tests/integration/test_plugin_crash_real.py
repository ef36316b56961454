"""The plugin process killed while the kubelet admits pods (SIGKILL, and SIGTERM), at several points around the
kubelet's Allocate calls, then started again as the DaemonSet's container restart would; under two CPU burners.
After each restart: no GPU held by two pods, no pod stranded (a pod whose admission was cut fails, as the real kubelet
fails it, and its owner's replacement is admitted), the Node's published used GPUs equal to PodResources, and every
pod whose planned GPUs were free at its admission holding its plan. The harness is tests/reliability/plugin_crash.py;
bench/plugin_crash.py sweeps many more kill points.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import signal

import pytest

from bench.common import burning
from tests.helpers.controlplane import ControlPlane, tidied
from tests.reliability.plugin_crash import WAIT, KillPoint, crash_node, run_round

pytestmark = [pytest.mark.timeout(300)]

# k-th Allocate of a round (4 pods), and how long after that call starts the signal goes: as the first call starts,
# with the third surely in flight (the plugin frozen meanwhile), just after the last, and a SIGTERM while a call is
# in flight.
IN_FLIGHT = KillPoint(3, 0.02, signal.SIGKILL, frozen=True)
POINTS = (KillPoint(1, 0.0, signal.SIGKILL), IN_FLIGHT, KillPoint(4, 0.003, signal.SIGKILL),
          KillPoint(2, 0.02, signal.SIGTERM, frozen=True))


def test_plugin_killed_during_allocate_gives_no_gpu_twice_strands_no_pod_and_republishes(
        real_control_plane: ControlPlane) -> None:
    with tidied(real_control_plane) as cp, crash_node(cp, "crash-dgx1", "plugin-crash") as node, burning(2):
        started = node.start_plugin()
        _, devices = node.wait_registered(started, WAIT)
        assert devices is not None, node.log_tail()
        failures, missed = [], []
        rounds = iter(range(100))
        for point in POINTS:
            for _ in range(3 if point is IN_FLIGHT else 1):  # on a loaded machine a kill can miss the call it aims at
                result = run_round(node, next(rounds), point)
                if not result.ok:
                    failures.append(result.as_dict())
                if point is not IN_FLIGHT or result.allocate_cut == 1:
                    break
                missed.append(result.as_dict())
            else:
                failures.append({"in flight": "no Allocate call was cut in 3 tries", "tries": missed})
        assert failures == [], "\n".join([*map(str, failures), node.log_tail()])

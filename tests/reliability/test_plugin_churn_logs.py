"""The plugin replaces its gRPC server (every kubelet restart deletes its socket) without an error and without a
line a log collector cannot parse, also on a node whose CPUs are busy.

Under load (2 CPU burners on 2 cores) 3 in 2,000 replacements used to log tracebacks: the server's loop was stopped
with the handlers of the calls it had just cut still pending, and the garbage collector later reported each
("Task was destroyed but it is pending", a ListAndWatch generator finalized on a closed loop: "Event loop is
closed", GeneratorExit, an ExecuteBatchError nobody retrieved); gRPC's core wrote its own lines ("Got goaway" at
every restart) as raw text beside the JSON. The long sweep is `python -m bench.plugin_churn` (2,000 restarts).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from bench import plugin_churn
from tests.gpuplugin.deviceplugin.conftest import DGX1
from tests.helpers.paths import REPO
from tests.reliability.conftest import WAIT

RESTARTS = 150


def test_server_replaced_150_times_under_cpu_load_with_streams_and_calls_in_flight_logs_only_clean_json() -> None:
    result = plugin_churn.run(RESTARTS, burners=2, settle_s=WAIT)
    assert result.restarts == RESTARTS
    assert result.unsettled == 0, f"{result.unsettled} restarts without registration and full list in {WAIT} s"
    assert result.calls > 0 and result.streams > 0, "the load never reached the plugin"
    assert result.exit_code == 0
    assert result.incidents == [], (f"{len(result.incidents)} incidents in {result.lines} lines:\n"
                                    + "\n".join(result.incidents[:10]))


# The server alone, in a process of its own (what is left at its end is reported there): streams whose clients
# stay connected and a server stopped without grace, which cuts their calls as they send their last status.
_SERVER_STOPS = textwrap.dedent("""
    import sys
    from pathlib import Path

    import grpc

    from gpuplugin.deviceplugin.resource import ResourceManager
    from gpuplugin.deviceplugin.server import PluginServer
    from gpuplugin.proto import deviceplugin_pb2 as pb
    from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
    from gputopo.discovery.loader import load_topology_file
    from gputopo.logs import configure_logging

    configure_logging("debug")
    manager = ResourceManager(load_topology_file(sys.argv[1]))
    socket = Path(sys.argv[2])
    for _ in range(10):
        server = PluginServer(manager, socket)
        server.start()
        channels = [grpc.insecure_channel(f"unix:{socket}") for _ in range(3)]
        calls = [pb_grpc.DevicePluginStub(c).ListAndWatch(pb.Empty()) for c in channels]
        for call in calls:
            next(call)
        server.stop(0.0)
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        del server
""")


def test_a_server_stopped_with_streams_open_leaves_nothing_to_report(plugin_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _SERVER_STOPS, str(DGX1), str(plugin_dir / "s.sock")],
                          cwd=REPO, capture_output=True, text=True, timeout=4 * WAIT,
                          env={"PATH": "/usr/bin:/bin", "GRPC_VERBOSITY": "ERROR", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines, incidents = plugin_churn.incidents(done.stderr)
    assert lines > 0
    assert incidents == [], "\n".join(incidents[:10])

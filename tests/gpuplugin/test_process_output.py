"""Every line `gpuplugin run` writes is one JSON object (gputopo.logs.ProcessOutput): its own logs unchanged,
Python's last-resort reports (a thread's uncaught exception, "Exception ignored in", warnings) through logging,
and what bypasses Python (gRPC's core writes absl lines straight to file descriptor 2) wrapped at its own level.
A collector parsing the node's logs used to meet raw "Traceback" blocks and "I1207 ... Got goaway" lines."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

from gputopo.logs import ProcessOutput
from tests.helpers.paths import REPO

_WRITES = textwrap.dedent("""
    import os
    import threading
    import warnings

    import structlog

    from gputopo.logs import ProcessOutput, configure_logging

    configure_logging("info")
    output = ProcessOutput("plugin", "info").start()
    structlog.get_logger().info("plugin.test.ours", n=1)
    os.write(2, b"I1207 17:24:55.685454    4540 chttp2_transport.cc:1403] unix:/x.sock: Got goaway [2]\\n")
    os.write(2, b"E1207 17:24:55.685454    4540 server.cc:10] an error from the core\\n")
    os.write(2, b"raw text from C\\n")
    os.write(2, b'{"event": "plugin.test.split", "level": "info"}')  # its newline comes after another line
    os.write(2, b"W1207 17:24:55.685454    4540 chttp2.cc:1] a warning in between\\n\\n")
    print("a stray print")
    warnings.warn("a warning", UserWarning, stacklevel=1)
    crasher = threading.Thread(target=lambda: 1 / 0, name="crasher")
    crasher.start()
    crasher.join()

    class Finalizer:
        def __del__(self) -> None:
            raise ValueError("failed in __del__")

    Finalizer()
    output.stop()
""")


def _run() -> tuple[list[dict[str, object]], list[dict[str, object]], str]:
    done = subprocess.run([sys.executable, "-c", _WRITES], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    err = [json.loads(line) for line in done.stderr.splitlines()]
    return out, err, done.stderr


def test_every_line_is_one_json_object_with_the_level_it_was_written_at() -> None:
    out, err, text = _run()
    assert "Traceback" not in text
    assert all(isinstance(e, dict) for e in [*out, *err])
    events = [(e["event"], e["level"]) for e in err]
    assert ("plugin.test.ours", "info") in events
    assert ("plugin.test.split", "info") in events
    core = {e["message"]: e["level"] for e in err if e["event"] == "plugin.grpc.message"}
    # the core's info lines follow the libraries' threshold (warning up unless debugging)
    assert core == {"an error from the core": "error", "a warning in between": "warning"}
    assert {"event": "plugin.native.message", "message": "raw text from C"}.items() <= next(
        e for e in err if e["event"] == "plugin.native.message").items()
    assert [(e["event"], e["message"], e["stream"]) for e in out] == [
        ("plugin.native.message", "a stray print", "stdout")]
    python = [e for e in err if e["event"] == "plugin.python.message"]
    assert {e["level"] for e in python} == {"error"} and len(python) == 2
    assert "crasher" in python[0]["message"] and python[0]["exception"][0]["exc_type"] == "ZeroDivisionError"
    assert python[1]["exception"][0]["exc_value"] == "failed in __del__"
    warned = [e for e in err if e["event"] == "plugin.py.message"]
    assert len(warned) == 1 and warned[0]["level"] == "warning" and "a warning" in str(warned[0]["message"])


def test_nothing_changes_where_stderr_is_not_the_process_own() -> None:
    """In a test (pytest captures stderr) or under click's CliRunner the hooks and descriptors stay as they are."""
    hook = threading.excepthook
    output = ProcessOutput("plugin", "info").start()
    try:
        assert threading.excepthook is hook
    finally:
        output.stop()

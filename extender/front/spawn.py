"""Starting the answering process (extender.front.answering), light on purpose (the standard library only):
`gpu-extender serve` starts it before its own imports, so the two processes import side by side (the answering
process alone took 1.7 s to be ready for its config on a 2-core machine).

The process gets one end of a socket pair as it starts; the listening socket follows over that pair (SCM_RIGHTS)
once the state process has bound it, then the config, then the channel's frames (extender.front.channel)."""

from __future__ import annotations

import socket
import subprocess
import sys

LISTEN_MARK = b"L"  # the byte the listening socket rides on
DEFAULT_COMMAND = [sys.executable, "-m", "extender.front"]

_EARLY: tuple[subprocess.Popen[bytes], socket.socket] | None = None


def spawn(command: list[str] | None = None) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """The process and this side's end of its channel."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([*(command or DEFAULT_COMMAND), "--channel-fd", str(child.fileno())],
                                pass_fds=(child.fileno(),))
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, parent


def start_early() -> None:
    """Spawn the first answering process now; extender.front.link takes it (take_early) instead of a new one."""
    global _EARLY
    if _EARLY is None:
        _EARLY = spawn()


def take_early() -> tuple[subprocess.Popen[bytes], socket.socket] | None:
    global _EARLY
    early, _EARLY = _EARLY, None
    return early


def cancel_early() -> None:
    """`serve` ends before it had use for the early process (a bad inventory, a port in use): it goes too."""
    early = take_early()
    if early is not None:
        proc, parent = early
        parent.close()  # it was waiting for the listening socket: end of file ends it
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hand_over(channel: socket.socket, listen: socket.socket) -> None:
    """Send the listening socket down the channel (blocking: the pair's buffer is empty at this point)."""
    socket.send_fds(channel, [LISTEN_MARK], [listen.fileno()])


def receive_listener(channel: socket.socket) -> socket.socket:
    """The answering process's side of hand_over."""
    data, fds, _flags, _addr = socket.recv_fds(channel, 1, 1)
    if not data and not fds:
        raise EOFError("the state process ended before it handed over the listening socket")
    if data != LISTEN_MARK or len(fds) != 1:
        raise RuntimeError(f"expected the listening socket on the channel, got {data!r} with {len(fds)} fds")
    return socket.socket(fileno=fds[0])

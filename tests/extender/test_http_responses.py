"""How `gpu-extender serve` writes its answers, against the real process over a raw socket: each answer leaves in
one send (kube-scheduler waits for every /filter and /prioritize answer, and each send is a system call and a
loopback wake-up: issue 24), while a 100 Continue still goes ahead of the body and a HEAD answer still arrives."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.extender.test_http_limits import WAIT, extender
from tests.helpers.scheduler import cache_args, pod_json


def read_answer(s: socket.socket) -> bytes:
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


def test_an_answer_arrives_in_one_piece_and_the_edge_cases_still_work(tmp_path: Path) -> None:
    body = json.dumps(cache_args(pod_json(gpus=2), ["a100"])).encode()
    request = (b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body))
    with extender(tmp_path) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
            for _ in range(20):
                s.sendall(request)
                first = s.recv(65536)  # waiting already when the server writes: a head sent alone comes alone
                head, _, rest = first.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                assert head.startswith(b"HTTP/1.1 200 ") and len(rest) == length, first
                assert json.loads(rest)["NodeNames"] == ["a100"]
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(body)
            assert b'"NodeNames":["a100"]' in read_answer(s)
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
            s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_answer(s).startswith(b"HTTP/1.1 ")

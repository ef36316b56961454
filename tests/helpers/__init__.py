"""Helpers the whole suite shares, one place each:

- paths: the repository, the read-only fixtures/ tree (recorded facts, with a manifest to prove nothing wrote
  there), the protocol references in docs/reference/, and short temporary directories for unix sockets;
- polling: `eventually`, for facts no one notifies about;
- processes: starting checks and stopping of the binaries the tests run as real processes;
- kube: Node and Pod objects as the apiserver stores them (GPU requests, topology/state annotations), kubeconfigs;
- scheduler: the bodies kube-scheduler sends the extender, from the recordings in fixtures/recordings/kube-scheduler.
"""

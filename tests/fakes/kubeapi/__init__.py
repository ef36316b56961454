"""An in-process kube-apiserver for tests: real HTTP on 127.0.0.1, real Kubernetes JSON.

Shapes (Status bodies, list metadata, watch events, bookmarks, 410 inside a watch, chunked bodies over 2 KiB) copy
the kube-apiserver v1.36.2 exchanges recorded in fixtures/recordings/kube-apiserver. Tests drive it through the
official client (never by patching the client), set state with add_*/update_*/delete_*, read `requests` for RBAC
proofs, and inject faults (fail_next, delay_next, expire_history, drop_watches, send_raw_watch_line).

One layer a module, each built on the one before:
- objects, status, selectors, patches: JSON helpers, Status bodies and ApiError, label/field selectors, PATCH bodies;
- store: objects, resourceVersions and the history of changes;
- listwatch: list paging and watch streams over the store, and the faults injected into watches;
- core: the core/v1 resources (nodes, pods, bindings);
- server: FakeKubeApi, served over transport (HTTP/1.1 plumbing), with its request log, auth and request faults;
- dra: FakeDraKubeApi, FakeKubeApi plus resource.k8s.io/v1; leases: FakeLeasesKubeApi, plus coordination.k8s.io/v1
  Leases; groups: FakeGroupsKubeApi, plus the gang schedulers'
  PodGroups and Workloads. Another API group is served the same way: a subclass that routes its paths in `_route`
  and hands others to `super()._route`.
"""

from tests.fakes.kubeapi.dra import FakeDraKubeApi
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.fakes.kubeapi.leases import FakeLeasesKubeApi
from tests.fakes.kubeapi.objects import Obj, clone, now
from tests.fakes.kubeapi.selectors import Selector, parse_label_selector
from tests.fakes.kubeapi.server import FakeKubeApi, RecordedRequest
from tests.fakes.kubeapi.status import ApiError, conflict, method_not_allowed, no_resource, not_found

__all__ = [
    "ApiError",
    "FakeDraKubeApi",
    "FakeGroupsKubeApi",
    "FakeKubeApi",
    "FakeLeasesKubeApi",
    "Obj",
    "RecordedRequest",
    "Selector",
    "clone",
    "conflict",
    "method_not_allowed",
    "no_resource",
    "not_found",
    "now",
    "parse_label_selector",
]

"""The job owner kinds on the in-process kube-apiserver: Kubeflow jobs, TrainJob, JobSet, LeaderWorkerSet.

Served like the group kinds (tests/fakes/kubeapi/groups.py, whose routes this reuses), in the shapes a real
kube-apiserver v1.36.2 gave (fixtures/recordings/kube-apiserver-jobs): list items carry apiVersion and kind, and
a resource whose CRD is not installed answers the mux's plain-text `404 page not found` (missing-crd-list-404.txt),
not a Status. `forbidden` resources answer 403 with the recorded Forbidden Status (forbidden-403-list.json), as
for a ServiceAccount that RBAC does not grant them. The recorded objects load with `recorded_object(file)`.
"""

from __future__ import annotations

import json
from typing import Any

from tests.fakes.kubeapi.groups import RESOURCES as GROUP_RESOURCES
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.fakes.kubeapi.objects import Obj
from tests.fakes.kubeapi.status import ApiError, status_failure
from tests.helpers.paths import SHARED

RECORDINGS = SHARED / "recordings" / "kube-apiserver-jobs"
ACCOUNT = "system:serviceaccount:gpu-topology:gpu-topology-extender"

JOB_RESOURCES: dict[tuple[str, str, str], tuple[str, bool]] = {
    ("kubeflow.org", "v1", "pytorchjobs"): ("PyTorchJob", True),
    ("kubeflow.org", "v1", "tfjobs"): ("TFJob", True),
    ("kubeflow.org", "v1", "xgboostjobs"): ("XGBoostJob", True),
    ("kubeflow.org", "v1", "paddlejobs"): ("PaddleJob", True),
    ("kubeflow.org", "v1", "jaxjobs"): ("JAXJob", True),
    ("kubeflow.org", "v1", "mpijobs"): ("MPIJob", True),  # the training operator's CRD ...
    ("kubeflow.org", "v2beta1", "mpijobs"): ("MPIJob", True),  # ... or the MPI operator's: one name, never both
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): ("TrainJob", True),
    ("jobset.x-k8s.io", "v1alpha2", "jobsets"): ("JobSet", True),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"): ("LeaderWorkerSet", True),
}
MPIJOB_V1 = ("kubeflow.org", "v1", "mpijobs")
SERVED = {**GROUP_RESOURCES, **JOB_RESOURCES}
_CRD_GROUPS = {g for (g, _, _), (_, custom) in SERVED.items() if custom}
NOT_FOUND_TEXT = (RECORDINGS / "missing-crd-list-404.txt").read_bytes()


def recorded_object(name: str) -> Obj:
    """A recorded GET body (e.g. "pytorchjob-get.json"), as the apiserver returned it."""
    obj: Obj = json.loads((RECORDINGS / name).read_text())
    return obj


class FakeJobsKubeApi(FakeGroupsKubeApi):
    """FakeGroupsKubeApi plus the job owner kinds; `installed` by default: everything but the v1 MPIJob (the final
    state of the recording: the MPI operator's v2beta1 CRD); `forbidden`: resources RBAC does not grant."""

    SERVED = SERVED

    def __init__(self, *, installed: set[tuple[str, str, str]] | None = None,
                 forbidden: set[tuple[str, str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(installed=set(SERVED) - {MPIJOB_V1} if installed is None else installed, **kwargs)
        self.forbidden = set(forbidden or ())

    def add_owner(self, obj: Obj) -> Obj:
        """Create a job owner object (a recorded one, or one shaped like it); apiVersion and kind say where."""
        return self.add_group(obj)

    def _route(self, h: Any, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "apis":
            rest = parts[3:]
            namespace = None
            if rest[:1] == ["namespaces"] and len(rest) >= 3:
                namespace, rest = rest[1], rest[2:]
            ident = (parts[1], parts[2], rest[0]) if rest else None
            if ident in self.forbidden:  # authorization runs before the resource is resolved: 403 even if missing
                verb = "watch" if query.get("watch") in ("1", "true") else ("get" if len(rest) > 1 else "list")
                scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
                raise ApiError(status_failure(
                    403, "Forbidden", f'{ident[2]}.{ident[0]} is forbidden: User "{ACCOUNT}" cannot {verb} resource '
                    f'"{ident[2]}" in API group "{ident[0]}" {scope}', {"group": ident[0], "kind": ident[2]}))
        super()._route(h, method, path, query, body)

    def _missing(self, h: Any, ident: tuple[str, str, str] | None) -> None:
        if ident is not None and ident[0] in _CRD_GROUPS:
            h.send_text(404, NOT_FOUND_TEXT)  # a CRD not installed: the mux answers, not the resource handler
            return
        super()._missing(h, ident)

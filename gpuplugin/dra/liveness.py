"""Whether a prepared claim's ResourceClaim still exists: the one fact that lets its GPUs go back without an
unprepare (the kubelet forgets a prepared claim when its checkpoint is lost, and then never unprepares it).

A claim is gone only on evidence from the apiserver: a 404 for its namespace/name, or an object of that name with
another uid (the claim was deleted and one of the same name created; uids are never reused, so the old claim
cannot come back). A claim's deletion waits for its deallocation (the delete-protection finalizer), which waits
for its pods to be gone, so a gone claim has no container left using its GPUs. Every other answer (403, 401, 5xx,
no answer, a timeout, an object without a uid) decides nothing: releasing on it could hand a running container's
GPUs to another claim, which is worse than holding them a while longer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpuplugin.dra.state import PreparedClaim
from gputopo.kube.errors import NotFound

ClaimGetter = Callable[[str, str], Mapping]  # (namespace, name) -> ResourceClaim dict; raises on failure
MAX_WHY = 300  # an apiserver message can be long; a log line and an error message carry this much of it


class Verdict(StrEnum):
    ALIVE = "alive"
    GONE = "gone"
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class Finding:
    uid: str
    claim: str  # namespace/name, for messages
    verdict: Verdict
    why: str


def judge(claim: PreparedClaim, get_claim: ClaimGetter) -> Finding:
    """One GET of the claim by namespace/name (bounded by the client's request timeout); never raises."""
    where = f"{claim.namespace}/{claim.name}"
    try:
        found = get_claim(claim.namespace, claim.name)
    except NotFound as e:
        return Finding(claim.uid, where, Verdict.GONE, f"no ResourceClaim {where} ({str(e)[:MAX_WHY]})")
    except Exception as e:  # 403, 401, 5xx, unreachable, a timeout: nothing is known about the claim
        return Finding(claim.uid, where, Verdict.UNDECIDED, f"{type(e).__name__}: {str(e)[:MAX_WHY]}")
    meta = found.get("metadata") if isinstance(found, Mapping) else None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    if not isinstance(uid, str) or not uid:
        return Finding(claim.uid, where, Verdict.UNDECIDED, f"the apiserver's ResourceClaim {where} has no uid")
    if uid != claim.uid:
        return Finding(claim.uid, where, Verdict.GONE, f"ResourceClaim {where} is another claim now (uid {uid})")
    return Finding(claim.uid, where, Verdict.ALIVE, "")

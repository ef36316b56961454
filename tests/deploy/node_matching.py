"""Where a workload's pods may go: its pod template's nodeSelector and required node affinity evaluated against a
node's labels, with the API server's semantics (k8s.io/component-helpers nodeaffinity):

- nodeSelector: every key present with exactly that value;
- requiredDuringSchedulingIgnoredDuringExecution: the nodeSelectorTerms are ORed, an empty list or a term without
  requirements matches no node; a term's matchExpressions are ANDed;
- In: the label present with one of the values; NotIn: absent, or a value not listed; Exists / DoesNotExist: the key
  present / absent; Gt / Lt: present and an integer above / below the one value.

matchFields (metadata.name) is answered for a node name given; taints and tolerations are not considered.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def _requirement(expression: Obj, labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        if not present or len(values) != 1:
            return False
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    raise ValueError(f"unknown node selector operator {operator!r}")


def term_matches(term: Obj, labels: dict[str, str], node_name: str = "") -> bool:
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    name = {"metadata.name": node_name}
    return (all(_requirement(e, labels) for e in expressions)
            and all(_requirement(f, name) for f in fields))


def pod_fits_node(pod: Obj, labels: dict[str, str], node_name: str = "") -> bool:
    """Whether a pod spec's nodeSelector and required node affinity admit a node with these labels."""
    for key, value in (pod.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(term_matches(t, labels, node_name) for t in required.get("nodeSelectorTerms") or [])


def runs_on(workload: Obj, labels: dict[str, str], node_name: str = "") -> bool:
    """Whether a DaemonSet (or any workload) would place a pod on a node with these labels."""
    return pod_fits_node(workload["spec"]["template"]["spec"], labels, node_name)

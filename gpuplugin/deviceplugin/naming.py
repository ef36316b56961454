"""Kubernetes naming rules the plugin's settings must meet before the kubelet sees them."""

from __future__ import annotations

import re

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def dns_subdomain_problem(value: str) -> str | None:
    if not value or len(value) > 253:
        return f"{value!r} must be 1-253 characters"
    if not _DNS_SUBDOMAIN_RE.match(value):
        return f"{value!r} is not a DNS subdomain (lowercase letters, digits, '-' and '.')"
    return None


def extended_resource_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name (what the kubelet's Register accepts), or None.

    Extended resources are `domain/name`, outside the kubernetes.io domains, and `requests.` + name must still be
    a qualified name (the kubelet checks that form for quota)."""
    if "/" not in name:
        return f"resource name {name!r} needs a domain: domain/name"
    if "kubernetes.io/" in name:
        return f"resource name {name!r} is in a kubernetes.io domain, reserved for native resources"
    if name.startswith("requests."):
        return f"resource name {name!r} must not start with 'requests.'"
    prefix, _, local = name.rpartition("/")
    if "/" in prefix:
        return f"resource name {name!r} has more than one '/'"
    problem = dns_subdomain_problem(prefix)
    if problem:
        return f"resource name domain {problem}"
    if len(local) > 63 or not _QUALIFIED_NAME_RE.match(local):
        return (
            f"resource name {name!r}: {local!r} must be 1-63 alphanumerics, '-', '_' or '.', alphanumeric at both ends"
        )
    return None

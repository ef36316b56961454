"""Kubelet DRA resource health API (generated)."""

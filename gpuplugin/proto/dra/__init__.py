"""Kubelet DRA plugin API (generated)."""

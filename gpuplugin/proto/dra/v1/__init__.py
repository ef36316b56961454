"""Kubelet DRA plugin API v1 (generated)."""

"""Kubelet plugin registration API v1 (generated)."""

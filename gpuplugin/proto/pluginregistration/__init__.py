"""Kubelet plugin registration API (generated)."""

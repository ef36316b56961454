"""Kubelet DRA resource health API v1alpha1 (generated)."""

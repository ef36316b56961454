"""Kubelet device plugin API v1beta1 (generated)."""

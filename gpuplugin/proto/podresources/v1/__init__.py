"""Kubelet pod resources API v1 (generated)."""

"""Kubelet pod resources API (generated)."""

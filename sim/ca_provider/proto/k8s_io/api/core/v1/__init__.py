"""Generated code of Kubernetes' api/core/v1 (scripts/gen_ca_proto.py)."""

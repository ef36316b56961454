"""Generated code of Kubernetes' api/core (scripts/gen_ca_proto.py)."""

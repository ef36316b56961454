"""Generated code of Kubernetes' api (scripts/gen_ca_proto.py)."""

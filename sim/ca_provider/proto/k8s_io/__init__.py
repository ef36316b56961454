"""Generated code of Kubernetes' protos (scripts/gen_ca_proto.py)."""

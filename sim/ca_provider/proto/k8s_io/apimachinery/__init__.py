"""Generated code of Kubernetes' apimachinery (scripts/gen_ca_proto.py)."""

"""Generated code of Kubernetes' apimachinery/pkg (scripts/gen_ca_proto.py)."""

"""Generated code of Kubernetes' apimachinery/pkg/runtime (scripts/gen_ca_proto.py)."""

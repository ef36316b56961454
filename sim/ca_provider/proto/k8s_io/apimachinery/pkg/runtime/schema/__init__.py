"""Generated code of Kubernetes' apimachinery/pkg/runtime/schema (scripts/gen_ca_proto.py)."""

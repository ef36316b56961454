"""Generated code of Kubernetes' apimachinery/pkg/api/resource (scripts/gen_ca_proto.py)."""

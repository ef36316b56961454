"""Generated code of Kubernetes' apimachinery/pkg/api (scripts/gen_ca_proto.py)."""

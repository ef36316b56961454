"""Generated code of Kubernetes' apimachinery/pkg/apis (scripts/gen_ca_proto.py)."""

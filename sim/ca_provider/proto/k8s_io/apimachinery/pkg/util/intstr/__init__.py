"""Generated code of Kubernetes' apimachinery/pkg/util/intstr (scripts/gen_ca_proto.py)."""

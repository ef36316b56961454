"""Generated code of Kubernetes' apimachinery/pkg/util (scripts/gen_ca_proto.py)."""

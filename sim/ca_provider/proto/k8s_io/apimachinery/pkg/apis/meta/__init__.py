"""Generated code of Kubernetes' apimachinery/pkg/apis/meta (scripts/gen_ca_proto.py)."""

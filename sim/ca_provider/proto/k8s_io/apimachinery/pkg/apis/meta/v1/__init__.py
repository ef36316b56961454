"""Generated code of Kubernetes' apimachinery/pkg/apis/meta/v1 (scripts/gen_ca_proto.py)."""

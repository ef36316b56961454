"""Generated code of the Cluster Autoscaler's externalgrpc protocol (scripts/gen_ca_proto.py)."""

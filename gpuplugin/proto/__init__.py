"""Generated kubelet API code (scripts/gen_proto.py); short aliases for the two APIs."""

from gpuplugin.proto.deviceplugin.v1beta1 import api_pb2 as deviceplugin_pb2
from gpuplugin.proto.deviceplugin.v1beta1 import api_pb2_grpc as deviceplugin_pb2_grpc
from gpuplugin.proto.podresources.v1 import api_pb2 as podresources_pb2
from gpuplugin.proto.podresources.v1 import api_pb2_grpc as podresources_pb2_grpc

__all__ = ["deviceplugin_pb2", "deviceplugin_pb2_grpc", "podresources_pb2", "podresources_pb2_grpc"]

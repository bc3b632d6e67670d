"""Display names of wire.proto's rank start-up phases, shared by the ranks' logs and `orbit up`."""

from proto import wire_pb2

PHASE_TEXT = {
    wire_pb2.PHASE_UNSPECIFIED: "unknown",
    wire_pb2.PHASE_CONNECT: "connect",
    wire_pb2.PHASE_JOIN_GROUP: "join group",
    wire_pb2.PHASE_LOAD: "load",
    wire_pb2.PHASE_KV_ALLOCATION: "KV allocation",
    wire_pb2.PHASE_GRAPH_CAPTURE: "graph capture",
    wire_pb2.PHASE_COLLECTIVES_CHECK: "collectives check",
}

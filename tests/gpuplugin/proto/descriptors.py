"""A generated message field written the way docs/reference/*.md writes it (type and label), so the proto tests
compare the committed descriptors with the kubelet's wire contract."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
}


def field_type(f: FieldDescriptor) -> str:
    """`string`, `map<string,Foo>`, a message's name, `enum Name`."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return f"map<{field_type(key)},{field_type(value)}>"
    if f.message_type is not None:
        return f.message_type.name
    if f.enum_type is not None:
        return f"enum {f.enum_type.name}"
    return _SCALARS[f.type]


def label(f: FieldDescriptor) -> str:
    """`repeated`, `optional` (proto3 explicit presence), or empty; a map has none."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        return ""
    if f.is_repeated:
        return "repeated"
    return "optional" if f.has_presence and f.containing_oneof is not None else ""

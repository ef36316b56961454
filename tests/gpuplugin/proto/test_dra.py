"""The DRA-side protos (plugin registration, DRA v1, dra-health v1alpha1) match the kubelet's wire contract as written
in docs/reference/dra-api.md: method paths, message and field names, numbers, labels and types, and the health
enum's values. (That the generated code is current is tests/gpuplugin/proto/test_deviceplugin.py's job: it regenerates
every proto.)"""

from __future__ import annotations

import re

from google.protobuf.descriptor import Descriptor

from gpuplugin.proto.dra.v1 import api_pb2 as dra_pb2
from gpuplugin.proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpuplugin.proto.pluginregistration.v1 import api_pb2 as reg_pb2
from tests.gpuplugin.proto.descriptors import field_type, label
from tests.helpers.paths import REFERENCE as DOCS_REFERENCE

REFERENCE = DOCS_REFERENCE / "dra-api.md"
MODULES = (reg_pb2, dra_pb2, health_pb2)


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in [*parts, cur] if p.strip()]


def reference() -> tuple[dict[str, tuple[str, str, bool]], dict[str, dict], dict[str, dict[str, int]]]:
    """(rpc path -> (in, out, server streaming), message -> {field: (number, label, type)}, enum -> values)."""
    text = REFERENCE.read_text().split("## 4.", 1)[0]
    rpcs, messages, enums = {}, {}, {}

    def message(name: str, body: str) -> None:
        fields = {}
        for part in _split_top(body, ";"):
            m = re.fullmatch(r"(\w+)=(\d+) (?:(repeated|optional) )?([\w<>,]+)(\{(.*)\})?", part)
            assert m, f"unreadable reference field {part!r}"
            ftype = m.group(4)
            if m.group(5):
                inner = m.group(6)
                if re.fullmatch(r"(\w+=\d+,?)+", inner):
                    enums[ftype] = {k: int(v) for k, v in (x.split("=") for x in inner.split(","))}
                    ftype = f"enum {ftype}"
                else:
                    message(ftype, inner.replace(";", "; ").replace("=1", "=1 string").replace("=2", "=2 string"))
            fields[m.group(1)] = (int(m.group(2)), m.group(3) or "", ftype)
        messages[name] = fields

    for raw in text.splitlines():
        line = raw.split("//")[0].strip()
        if m := re.fullmatch(r"rpc (\S+) \((\w+)(\{\})?\) returns \((stream )?(\w+)(\{\})?\)", line):
            rpcs[m.group(1)] = (m.group(2), m.group(5), bool(m.group(4)))
            for name, empty in ((m.group(2), m.group(3)), (m.group(5), m.group(6))):
                if empty:
                    messages[name] = {}
        elif m := re.fullmatch(r"(\w+) \{(.*)\}", line):
            message(m.group(1), m.group(2))
    return rpcs, messages, enums


def test_descriptors_match_the_reference() -> None:
    ref_rpcs, ref_messages, ref_enums = reference()
    rpcs: dict[str, tuple[str, str, bool]] = {}
    messages: dict[str, Descriptor] = {}
    enums = {}
    for module in MODULES:
        fd = module.DESCRIPTOR
        for service in fd.services_by_name.values():
            for method in service.methods:
                assert not method.client_streaming
                rpcs[f"/{service.full_name}/{method.name}"] = (
                    method.input_type.name, method.output_type.name, method.server_streaming)
        messages.update(fd.message_types_by_name)
        enums.update({name: {v.name: v.number for v in e.values} for name, e in fd.enum_types_by_name.items()})
    assert rpcs == ref_rpcs
    assert sorted(messages) == sorted(ref_messages)
    for name, expected in ref_messages.items():
        got = {f.name: (f.number, label(f), field_type(f)) for f in messages[name].fields}
        assert got == expected, name
    assert enums == ref_enums


def test_reference_parse_covers_every_service() -> None:
    """Guards the test above against a reference format change that would make it compare nothing."""
    rpcs, messages, enums = reference()
    assert len(rpcs) == 5 and enums == {"HealthStatus": {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}}
    assert messages["Device"]["share_id"] == (5, "optional", "string")
    assert messages["DeviceIdentifier"] == {"pool_name": (1, "", "string"), "device_name": (2, "", "string")}

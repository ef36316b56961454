"""The committed generated code is current, and its descriptors match the kubelet's wire contract as written in
docs/reference/kubelet-device-plugin-api.md (method paths, packages, field names, numbers, types)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FileDescriptor

from gpuplugin.proto import deviceplugin_pb2, podresources_pb2
from tests.gpuplugin.proto.descriptors import field_type, label
from tests.helpers.paths import REFERENCE as DOCS_REFERENCE
from tests.helpers.paths import REPO

REFERENCE = DOCS_REFERENCE / "kubelet-device-plugin-api.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current(tmp_path: Path) -> None:
    gen = _load_generator()
    gen.generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "gpuplugin" / "proto").rglob("*.py")}
    committed = {p.relative_to(REPO): p.read_bytes() for p in (REPO / "gpuplugin" / "proto").rglob("*.py")}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/gen_proto.py"
    stale = [str(p) for p in fresh if fresh[p] != committed[p]]
    assert not stale, f"stale generated files (run scripts/gen_proto.py): {stale}"


def _reference() -> dict[str, dict]:
    """package -> {"rpcs": {path: (in, out, streaming)}, "messages": {name: {field: (num, label, type)}}}"""
    out: dict[str, dict] = {}
    current = None
    section = REFERENCE.read_text().split("## Method paths", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"package (\w+)", line):
            current = out.setdefault(m.group(1), {"rpcs": {}, "messages": {}})
        elif m := re.fullmatch(r"rpc (\S+) \((\w+)\) returns \((stream )?(\w+)\)", line):
            current["rpcs"][m.group(1)] = (m.group(2), m.group(4), bool(m.group(3)))
        elif m := re.fullmatch(r"(\w+) \{(.*)\}", line):
            fields = {}
            for part in filter(None, (p.strip() for p in m.group(2).split(";"))):
                fm = re.fullmatch(r"(\w+)=(\d+) (?:(repeated|optional) )?(\S+)", part)
                assert fm, f"unreadable reference field {part!r}"
                fields[fm.group(1)] = (int(fm.group(2)), fm.group(3) or "", fm.group(4))
            current["messages"][m.group(1)] = fields
    return out


def _messages(fd: FileDescriptor) -> dict[str, Descriptor]:
    return dict(fd.message_types_by_name)


@pytest.mark.parametrize(("package", "module"), [("v1beta1", deviceplugin_pb2), ("v1", podresources_pb2)])
def test_descriptors_match_reference(package: str, module: object) -> None:
    ref = _reference()[package]
    fd: FileDescriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    assert fd.package == package

    rpcs = {}
    for service in fd.services_by_name.values():
        for method in service.methods:
            rpcs[f"/{service.full_name}/{method.name}"] = (
                method.input_type.name,
                method.output_type.name,
                method.server_streaming,
            )
            assert not method.client_streaming
    assert rpcs == ref["rpcs"]

    messages = _messages(fd)
    assert sorted(messages) == sorted(ref["messages"])
    for name, expected in ref["messages"].items():
        got = {f.name: (f.number, label(f), field_type(f)) for f in messages[name].fields}
        assert got == expected, name


def test_reference_parse_covers_every_rpc() -> None:
    """Guards the test above against a reference format change that would make it compare nothing."""
    ref = _reference()
    assert len(ref["v1beta1"]["rpcs"]) == 6 and len(ref["v1"]["rpcs"]) == 3
    assert ref["v1beta1"]["messages"]["ContainerPreferredAllocationRequest"]["allocation_size"] == (3, "", "int32")

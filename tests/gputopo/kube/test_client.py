"""make_api_client / credentials_available: where credentials come from."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.config.incluster_config import SERVICE_TOKEN_FILENAME

from gputopo.kube import KubeConfigError, credentials_available, get_node, make_api_client, request_timeout
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_node, write_kubeconfig


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if Path(SERVICE_TOKEN_FILENAME).exists():
        pytest.skip("this machine has a service-account token")
    return tmp_path


def test_explicit_host_and_token(tmp_path):
    with FakeKubeApi(token="tok") as fake:
        fake.add_node(k8s_node("n"))
        client = make_api_client(host=fake.url + "/", token="tok", timeout_s=2.5)
        try:
            assert request_timeout(client) == 2.5
            assert get_node(client, "n")["metadata"]["name"] == "n"
        finally:
            client.close()


def test_kubeconfig_file(tmp_path):
    with FakeKubeApi(token="from-kubeconfig") as fake:
        fake.add_node(k8s_node("n"))
        cfg = write_kubeconfig(tmp_path / "config", fake.url, "from-kubeconfig")
        client = make_api_client(kubeconfig=str(cfg))
        try:
            assert get_node(client, "n")["metadata"]["name"] == "n"
        finally:
            client.close()


def test_default_kubeconfig_from_env(no_credentials, monkeypatch):
    with FakeKubeApi(token="env") as fake:
        fake.add_node(k8s_node("n"))
        cfg = write_kubeconfig(no_credentials / "kc", fake.url, "env")
        assert not credentials_available()
        monkeypatch.setenv("KUBECONFIG", str(cfg))
        assert credentials_available()
        client = make_api_client()
        try:
            assert get_node(client, "n")["metadata"]["name"] == "n"
        finally:
            client.close()


def test_home_kubeconfig_counts_as_credentials(no_credentials):
    (no_credentials / ".kube").mkdir()
    write_kubeconfig(no_credentials / ".kube" / "config", "http://127.0.0.1:1", "x")
    assert credentials_available()


def test_no_credentials_is_a_clear_error(no_credentials):
    assert not credentials_available()
    with pytest.raises(KubeConfigError, match="no Kubernetes credentials"):
        make_api_client()


def test_broken_kubeconfig_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("clusters: [")
    with pytest.raises(KubeConfigError, match="cannot load"):
        make_api_client(kubeconfig=str(bad))
    with pytest.raises(KubeConfigError):
        make_api_client(host="http://127.0.0.1:1", timeout_s=0)

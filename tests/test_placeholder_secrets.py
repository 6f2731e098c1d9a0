"""The secrets k8s/base/secrets.yaml publishes are refused at start, from a config field or from the
environment, with an error naming the setting and where a real secret goes; no Ray is needed to see it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.app import build_app
from cluster.config import ConfigError, key_tenant, load_config, parse_api_keys

SECRETS = Path(__file__).resolve().parents[1] / "k8s" / "base" / "secrets.yaml"
ENV = ("TANDEM_API_KEYS", "TANDEM_ADMIN_KEY", "TANDEM_KV_TOKEN")


def published() -> dict[str, str]:
    """Each Secret's key -> its published value."""
    return {key: value for doc in yaml.safe_load_all(SECRETS.read_text()) for key, value in doc["stringData"].items()}


@pytest.fixture(autouse=True)
def no_secrets_in_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_published_secrets_are_the_two_keys():
    values = published()
    assert set(values) == {"api-keys", "admin-key"}
    assert all("placeholder" in value for value in values.values())


def test_placeholder_api_key_in_the_config_is_refused():
    [key] = parse_api_keys(published()["api-keys"])
    with pytest.raises(ConfigError, match=rf"'api_keys': .*api_keys is the published placeholder '{key}'.*TANDEM_API_KEYS"):
        load_config(api_keys={"real-key": "a", key: "b"})


def test_placeholder_admin_key_in_the_config_is_refused():
    with pytest.raises(ConfigError, match=r"'admin_key': .*published placeholder.*TANDEM_ADMIN_KEY"):
        load_config(admin_key=published()["admin-key"])


def test_placeholder_kv_token_in_the_config_is_refused():
    with pytest.raises(ConfigError, match=r"'transfer.token': .*published placeholder.*TANDEM_KV_TOKEN"):
        load_config(**{"transfer.token": "placeholder-kv-token-replace-me"})


@pytest.mark.parametrize("name, value", [
    ("TANDEM_API_KEYS", published()["api-keys"]),
    ("TANDEM_API_KEYS", f"real-key:a,{published()['api-keys']}:b"),
    ("TANDEM_ADMIN_KEY", published()["admin-key"]),
    ("TANDEM_KV_TOKEN", "placeholder-kv-token-replace-me"),
])
def test_placeholder_in_the_environment_is_refused_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"^{name} is the published placeholder .*Set a real secret"):
        load_config()


def test_the_kuberay_entry_point_refuses_before_it_starts_anything(monkeypatch):
    """build_app (serveConfigV2's import_path) reads the keys from the pods' environment, as on Kubernetes."""
    monkeypatch.setenv("TANDEM_ADMIN_KEY", published()["admin-key"])
    with pytest.raises(ConfigError, match="TANDEM_ADMIN_KEY is the published placeholder"):
        build_app({"model": "smollm2-135m-instruct"})


def test_real_secrets_are_kept(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "k1:tenant-a,placeholder-for-nothing")
    monkeypatch.setenv("TANDEM_KV_TOKEN", "replace-me-placeholder")
    config = load_config(admin_key="a-placeholder-admin-key-replace-me-not")
    assert config.api_keys == {"k1": "tenant-a", "placeholder-for-nothing": key_tenant("placeholder-for-nothing")}
    assert config.admin_key == "a-placeholder-admin-key-replace-me-not"
    assert config.transfer_config().token == "replace-me-placeholder"

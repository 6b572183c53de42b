"""Kafka SASL/TLS settings: validation, the aiokafka arguments every client is built with, no secret shown,
and what a SASL client does against the embedded broker."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from opml_common.bus import EventConsumer, EventPublisher, ensure_topics, kafka_client_kwargs
from opml_common.bus.security import describe
from opml_common.config import PlatformSettings
from opml_common.errors import Unavailable
from opml_common.topics import Topic
from opml_devstack.testing.bus import fresh_metrics

PASSWORD = "s3cr3t-pa55word-for-the-test"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("OPML_")]:
        monkeypatch.delenv(key)


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA certificate and key made by openssl for this test module."""
    root = tmp_path_factory.mktemp("pem")
    cert, key = root / "ca.pem", root / "ca.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=opml-test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return {"cert": cert, "key": key}


def _sasl(**extra: object) -> PlatformSettings:
    return PlatformSettings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="bundle-store",
                            kafka_sasl_password=PASSWORD, **extra)


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    assert kafka_client_kwargs(PlatformSettings()) == {"bootstrap_servers": "127.0.0.1:9092",
                                                       "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_plaintext_passes_the_mechanism_user_and_password(mechanism: str) -> None:
    kwargs = kafka_client_kwargs(_sasl(kafka_sasl_mechanism=mechanism))
    assert kwargs == {"bootstrap_servers": "127.0.0.1:9092", "security_protocol": "SASL_PLAINTEXT",
                      "sasl_mechanism": mechanism, "sasl_plain_username": "bundle-store",
                      "sasl_plain_password": PASSWORD}


def test_sasl_ssl_adds_a_verifying_tls_context_from_the_ca_file(pem: dict[str, Path]) -> None:
    kwargs = kafka_client_kwargs(PlatformSettings(
        kafka_security_protocol="SASL_SSL", kafka_sasl_username="u", kafka_sasl_password=PASSWORD,
        kafka_ssl_cafile=str(pem["cert"]), kafka_ssl_certfile=str(pem["cert"]), kafka_ssl_keyfile=str(pem["key"])))
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "opml-test"),),)]
    assert kwargs["security_protocol"] == "SASL_SSL" and kwargs["sasl_plain_password"] == PASSWORD


def test_ssl_without_a_ca_file_uses_the_systems_cas() -> None:
    kwargs = kafka_client_kwargs(PlatformSettings(kafka_security_protocol="SSL"))
    assert kwargs["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert "sasl_mechanism" not in kwargs


@pytest.mark.parametrize(("settings", "message"), [
    ({"kafka_security_protocol": "SASL_SSL"}, "OPML_KAFKA_SASL_USERNAME and OPML_KAFKA_SASL_PASSWORD must be set"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_username": "u"}, "OPML_KAFKA_SASL_PASSWORD must be set"),
    ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_username": "u", "kafka_sasl_password": PASSWORD,
      "kafka_sasl_mechanism": "GSSAPI"}, "kafka_sasl_mechanism"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_cafile": "/no/such/ca.pem"}, "kafka_ssl_cafile"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_certfile": "/no/such/cert.pem"}, "kafka_ssl_certfile"),
])
def test_inconsistent_settings_are_refused_naming_the_variable(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        PlatformSettings(**settings)
    assert PASSWORD not in str(caught.value)


def test_tls_files_with_a_protocol_without_tls_and_a_key_without_its_certificate_are_refused(pem) -> None:
    with pytest.raises(ValidationError, match="OPML_KAFKA_SSL_CAFILE only apply to .*SSL or SASL_SSL"):
        PlatformSettings(kafka_security_protocol="PLAINTEXT", kafka_ssl_cafile=str(pem["cert"]))
    with pytest.raises(ValidationError, match="OPML_KAFKA_SSL_KEYFILE needs OPML_KAFKA_SSL_CERTFILE"):
        PlatformSettings(kafka_security_protocol="SSL", kafka_ssl_keyfile=str(pem["key"]))


def test_prod_refuses_plaintext_unless_it_is_explicitly_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPML_ENV", "prod")
    monkeypatch.setenv("OPML_AUTH_TOKENS", "t=admin")
    monkeypatch.setenv("OPML_S3_SECRET_KEY", "a-real-secret")
    with pytest.raises(ValidationError, match="PLAINTEXT is refused when OPML_ENV=prod"):
        PlatformSettings()
    monkeypatch.setenv("OPML_KAFKA_ALLOW_PLAINTEXT", "true")
    assert PlatformSettings().kafka_security_protocol == "PLAINTEXT"
    monkeypatch.delenv("OPML_KAFKA_ALLOW_PLAINTEXT")
    monkeypatch.setenv("OPML_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("OPML_KAFKA_SASL_USERNAME", "router")
    monkeypatch.setenv("OPML_KAFKA_SASL_PASSWORD", PASSWORD)
    settings = PlatformSettings()
    assert settings.env == "prod" and kafka_client_kwargs(settings)["sasl_plain_username"] == "router"


def test_the_password_is_never_shown() -> None:
    settings = _sasl()
    for text in (repr(settings), str(settings), describe(settings), str(settings.model_dump())):
        assert PASSWORD not in text
    assert describe(settings) == "127.0.0.1:9092 (SASL_PLAINTEXT, SCRAM-SHA-512 as 'bundle-store')"


# -- against the embedded broker (tansu). It runs without authentication here; see docs/security.md
# for what it does and does not enforce. A SASL client must fail fast and clearly, never hang.


def _clients(settings: PlatformSettings):
    metrics, _ = fresh_metrics()
    topic = Topic(name="opml.sasl-test.v1", partitions=1)

    async def handler(event) -> None:
        raise AssertionError("no event can arrive")

    publisher = EventPublisher(settings, source="sasl-test", metrics=metrics)
    consumer = EventConsumer(settings, group_id="sasl-test", topics=[topic], handler=handler, metrics=metrics)
    return {"producer": publisher.start, "consumer": consumer.start, "admin": lambda: ensure_topics(settings, [topic])}


@pytest.mark.parametrize("client", ["producer", "consumer", "admin"])
def test_every_client_authenticates_with_sasl_and_fails_clearly_against_a_broker_without_it(
        infra, client: str) -> None:
    settings = PlatformSettings(kafka_bootstrap=infra.kafka_bootstrap, kafka_security_protocol="SASL_PLAINTEXT",
                                kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="router",
                                kafka_sasl_password=PASSWORD)
    with pytest.raises(Unavailable) as caught:
        asyncio.run(asyncio.wait_for(_clients(settings)[client](), timeout=60))
    message = str(caught.value)
    assert infra.kafka_bootstrap in message and "SASL_PLAINTEXT" in message, message
    assert caught.value.code == "UNAVAILABLE" and PASSWORD not in message

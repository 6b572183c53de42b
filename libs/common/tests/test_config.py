import pytest
from pydantic import ValidationError

from opml_common.config import PlatformSettings, parse_tokens


def test_zero_config_points_at_the_embedded_infrastructure(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OPML_KAFKA_BOOTSTRAP", "OPML_S3_ENDPOINT", "OPML_REDIS_URL", "OPML_AUTH_TOKENS", "OPML_ENV"):
        monkeypatch.delenv(key, raising=False)
    settings = PlatformSettings()
    assert settings.kafka_bootstrap == "127.0.0.1:9092"
    assert settings.s3_endpoint == "http://127.0.0.1:8333"
    assert settings.kafka_idempotence is False and settings.tokens() == {}


@pytest.mark.parametrize("env, field", [
    ({"OPML_KAFKA_BOOTSTRAP": "localhost"}, "kafka_bootstrap"),
    ({"OPML_S3_ENDPOINT": "127.0.0.1:8333"}, "s3_endpoint"),
    ({"OPML_KAFKA_SESSION_TIMEOUT_MS": "10"}, "kafka_session_timeout_ms"),
    ({"OPML_ENV": "staging"}, "env"),
])
def test_bad_values_fail_at_start_up_naming_the_variable(monkeypatch, env, field) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match=field):
        PlatformSettings()


def test_prod_refuses_to_trust_callers_without_tokens(monkeypatch) -> None:
    monkeypatch.setenv("OPML_ENV", "prod")
    monkeypatch.delenv("OPML_AUTH_TOKENS", raising=False)
    with pytest.raises(ValidationError, match="OPML_AUTH_TOKENS must be set"):
        PlatformSettings()


def test_prod_refuses_the_public_dev_s3_secret(monkeypatch) -> None:
    monkeypatch.setenv("OPML_ENV", "prod")
    monkeypatch.setenv("OPML_AUTH_TOKENS", "t=admin")
    monkeypatch.delenv("OPML_S3_SECRET_KEY", raising=False)
    with pytest.raises(ValidationError, match="OPML_S3_SECRET_KEY must be set"):
        PlatformSettings()
    monkeypatch.setenv("OPML_S3_SECRET_KEY", "a-real-secret")
    monkeypatch.setenv("OPML_KAFKA_ALLOW_PLAINTEXT", "true")  # prod's Kafka rule: test_bus_security.py
    assert PlatformSettings().env == "prod"


def test_secrets_are_not_printed(monkeypatch) -> None:
    monkeypatch.setenv("OPML_S3_SECRET_KEY", "hunter2")
    monkeypatch.setenv("OPML_AUTH_TOKENS", "s3cr3t=admin")
    text = repr(PlatformSettings())
    assert "hunter2" not in text and "s3cr3t" not in text


@pytest.mark.parametrize("url", ["default:hunter2@redis.internal:6379/0", "redis:/u:hunter2@h:6379"])
def test_a_redis_url_without_its_scheme_is_refused_without_its_password(monkeypatch, url: str) -> None:
    monkeypatch.setenv("OPML_REDIS_URL", url)
    with pytest.raises(ValidationError, match="redis_url") as caught:
        PlatformSettings()
    assert "hunter2" not in str(caught.value) and "must start with redis://" in str(caught.value)


def test_token_roles() -> None:
    grants = parse_tokens("a=admin, b=reader+writer, ci-bot:c=inference")
    assert {token: grant.roles for token, grant in grants.items()} == {
        "a": frozenset({"admin"}), "b": frozenset({"reader", "writer"}), "c": frozenset({"inference"})}
    assert grants["c"].name == "ci-bot"
    assert grants["a"].name.startswith("token:") and len(grants["a"].name) == len("token:") + 8  # a hash prefix
    with pytest.raises(ValueError, match="roles must be among"):
        parse_tokens("a=root")
    with pytest.raises(ValueError, match=r"token=role"):
        parse_tokens("justatoken")
    with pytest.raises(ValueError, match="repeats a name"):
        parse_tokens("x:t1=reader,x:t2=admin")

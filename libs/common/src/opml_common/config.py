"""Typed configuration read from ``OPML_*`` environment variables.

Every service runs with zero configuration against the embedded infrastructure that
``opml infra up`` starts (tansu on 127.0.0.1:9092, SeaweedFS S3 on 127.0.0.1:8333, the
machine's Redis). Values are validated once at start-up so a typo fails fast with the
variable named, not later in a request. docs/configuration.md lists every variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ROLES = ("reader", "writer", "admin")
DEV_S3_SECRET = "opml-secret"  # the embedded SeaweedFS's secret; public, so refused in prod


class PlatformSettings(BaseSettings):
    """Settings every service shares: where the infrastructure is and how to talk to it."""

    model_config = SettingsConfigDict(env_prefix="OPML_", frozen=True, extra="ignore")

    env: Literal["dev", "prod"] = Field(
        "dev", description="`prod` refuses to start without auth tokens and S3 credentials from config."
    )
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma separated.")
    kafka_idempotence: bool = Field(
        False, description="Idempotent producer (InitProducerId). On for Apache Kafka; tansu rejects it."
    )
    kafka_replication_factor: int = Field(
        1, ge=1, description="Replicas of each topic the platform creates (1 on tansu, 3 on a production cluster)."
    )
    kafka_session_timeout_ms: int = Field(6000, ge=1000, description="Consumer group session timeout.")
    kafka_heartbeat_interval_ms: int = Field(1000, ge=100, description="Consumer group heartbeat interval.")
    topic_prefix: str = Field("", description="Prepended to every topic name (tests use a unique one per run).")
    s3_endpoint: str = Field("http://127.0.0.1:8333", description="S3 endpoint URL (http:// or https://).")
    s3_access_key: SecretStr = Field(SecretStr("opml"), description="S3 access key.")
    s3_secret_key: SecretStr = Field(SecretStr(DEV_S3_SECRET), description="S3 secret key.")
    s3_region: str = Field("us-east-1", description="S3 region.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL for hot state and dedup keys.")
    redis_prefix: str = Field("opml:", description="Prepended to every Redis key (tests use a unique one).")
    auth_tokens: SecretStr = Field(
        SecretStr(""),
        description="Bearer tokens and their roles: `token=role[+role],...` (roles: reader, writer, admin). "
        "Empty in dev: callers are anonymous admins, with a warning at start-up.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["json", "text"] = Field("json", description="Structured JSON logs or plain text.")

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_ports(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"each server must be host:port, but got {server!r}")
        return value

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint_has_scheme(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, but got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _prod_needs_secrets(self) -> PlatformSettings:
        if self.env == "prod" and not self.auth_tokens.get_secret_value():
            raise ValueError("OPML_AUTH_TOKENS must be set when OPML_ENV=prod (callers are never trusted)")
        if self.env == "prod" and self.s3_secret_key.get_secret_value() == DEV_S3_SECRET:
            raise ValueError("OPML_S3_SECRET_KEY must be set when OPML_ENV=prod (the dev default is public)")
        parse_tokens(self.auth_tokens.get_secret_value())  # validates the syntax at start-up
        return self

    # --- Kafka security (SASL and TLS), used by every client through opml_common.bus.security ---------
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How clients talk to the brokers: PLAINTEXT (the embedded tansu), SSL (TLS), "
        "SASL_PLAINTEXT or SASL_SSL (SASL authentication, without or with TLS). OPML_ENV=prod refuses PLAINTEXT "
        "unless `kafka_allow_plaintext` is set.")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "SCRAM-SHA-512", description="SASL mechanism when the protocol is SASL_*. PLAIN sends the password as "
        "it is: use it only with SASL_SSL.")
    kafka_sasl_username: str = Field("", description="SASL user of this service (required with SASL_*).")
    kafka_sasl_password: SecretStr = Field(
        SecretStr(""), description="SASL password of this service (required with SASL_*; never logged).")
    kafka_ssl_cafile: str = Field(
        "", description="PEM file of the CAs that sign the brokers' certificates (SSL, SASL_SSL); empty: the "
        "system's CAs. Must exist.")
    kafka_ssl_certfile: str = Field(
        "", description="PEM client certificate for TLS client authentication (SSL, SASL_SSL). Must exist.")
    kafka_ssl_keyfile: str = Field(
        "", description="PEM private key of `kafka_ssl_certfile` (SSL, SASL_SSL). Must exist.")
    kafka_allow_plaintext: bool = Field(
        False, description="Let OPML_ENV=prod talk to Kafka over PLAINTEXT (no authentication, no encryption): "
        "only for a broker on a network nobody else can reach.")

    @field_validator("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile")
    @classmethod
    def _kafka_file_exists(cls, value: str) -> str:
        if value and not Path(value).expanduser().is_file():
            raise ValueError(f"must be an existing file, but {value!r} is not a file")
        return str(Path(value).expanduser()) if value else value

    @model_validator(mode="after")
    def _kafka_security_is_consistent(self) -> PlatformSettings:
        protocol = self.kafka_security_protocol
        if protocol.startswith("SASL_"):
            missing = [name for name, value in (("OPML_KAFKA_SASL_USERNAME", self.kafka_sasl_username),
                                                ("OPML_KAFKA_SASL_PASSWORD", self.kafka_sasl_password.get_secret_value()))
                       if not value]
            if missing:
                raise ValueError(f"{' and '.join(missing)} must be set when OPML_KAFKA_SECURITY_PROTOCOL={protocol}")
        if not protocol.endswith("SSL"):
            given = [name for name, value in (("OPML_KAFKA_SSL_CAFILE", self.kafka_ssl_cafile),
                                              ("OPML_KAFKA_SSL_CERTFILE", self.kafka_ssl_certfile),
                                              ("OPML_KAFKA_SSL_KEYFILE", self.kafka_ssl_keyfile)) if value]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to OPML_KAFKA_SECURITY_PROTOCOL=SSL or SASL_SSL, "
                                 f"but it is {protocol}")
        if self.kafka_ssl_keyfile and not self.kafka_ssl_certfile:
            raise ValueError("OPML_KAFKA_SSL_KEYFILE needs OPML_KAFKA_SSL_CERTFILE (the certificate of that key)")
        if self.env == "prod" and protocol == "PLAINTEXT" and not self.kafka_allow_plaintext:
            raise ValueError("OPML_KAFKA_SECURITY_PROTOCOL=PLAINTEXT is refused when OPML_ENV=prod (anyone who "
                             "reaches the broker could forge events): use SASL_SSL, SSL or SASL_PLAINTEXT, or set "
                             "OPML_KAFKA_ALLOW_PLAINTEXT=true for a broker nobody else can reach")
        return self
    # --- end of Kafka security --------------------------------------------------------------------------

    def tokens(self) -> dict[str, frozenset[str]]:
        """The bearer tokens and the roles each one carries."""
        return parse_tokens(self.auth_tokens.get_secret_value())


class ServiceSettings(BaseSettings):
    """Where one service listens. Subclasses set ``env_prefix`` to ``OPML_<SERVICE>_``."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore")

    host: str = Field("127.0.0.1", description="Interface the gRPC and metrics servers bind.")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    shutdown_grace_s: float = Field(5.0, ge=0, description="Seconds in-flight RPCs get on shutdown.")


def parse_tokens(spec: str) -> dict[str, frozenset[str]]:
    """Parse ``token=role+role,token2=role`` into a map; raises ValueError naming the bad entry."""
    tokens: dict[str, frozenset[str]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        token, sep, roles = entry.partition("=")
        if not sep or not token:
            raise ValueError("auth_tokens entries must be token=role[+role], but one entry has no '='")
        role_set = frozenset(filter(None, roles.split("+")))
        unknown = role_set - set(ROLES)
        if not role_set or unknown:
            raise ValueError(f"auth_tokens roles must be among {ROLES}, but got {sorted(unknown) or 'none'}")
        tokens[token] = role_set
    return tokens

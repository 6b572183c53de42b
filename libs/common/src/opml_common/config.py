"""Typed configuration read from ``OPML_*`` environment variables.

Every service runs with zero configuration against the embedded infrastructure that
``opml infra up`` starts (tansu on 127.0.0.1:9092, SeaweedFS S3 on 127.0.0.1:8333, the
machine's Redis). Values are validated once at start-up so a typo fails fast with the
variable named, not later in a request. docs/configuration.md lists every variable.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Lowest to highest: each role can do what the ones before it can. ``inference`` may call ModelInfer
# (and read) but not deploy, shift traffic or promote, which need writer (docs/security.md).
ROLES = ("reader", "inference", "writer", "admin")
DEV_S3_SECRET = "opml-secret"  # the embedded SeaweedFS's secret; public, so refused in prod


# --- gRPC transport security (TLS, mTLS) --------------------------------------------------------


class GrpcTlsSettings(BaseSettings):
    """TLS on gRPC, for servers and clients alike (a service is both). Read from ``OPML_GRPC_TLS_*``
    by every server (:class:`~opml_common.grpc.server.GrpcServer`), client
    (:func:`~opml_common.grpc.client.open_channel`), health probe and the CLI, so one set of
    variables turns TLS on across the platform. Unset: plaintext (dev)."""

    model_config = SettingsConfigDict(env_prefix="OPML_", frozen=True, extra="ignore", hide_input_in_errors=True)

    grpc_tls_cert: Path | None = Field(None, description="Server: PEM certificate chain; with the key, every gRPC "
                                       "server listens with TLS only (plaintext clients are refused).")
    grpc_tls_key: Path | None = Field(None, description="Server: PEM private key of `OPML_GRPC_TLS_CERT`.")
    grpc_tls_client_ca: Path | None = Field(None, description="Server: PEM CA bundle; set, a client must present "
                                            "a certificate it signed (mTLS).")
    grpc_tls_ca: Path | None = Field(None, description="Client: PEM CA bundle that signs the servers' "
                                     "certificates; set, every client connects with TLS.")
    grpc_tls_client_cert: Path | None = Field(None, description="Client: PEM certificate presented to servers "
                                              "that require mTLS.")
    grpc_tls_client_key: Path | None = Field(None, description="Client: PEM private key of "
                                             "`OPML_GRPC_TLS_CLIENT_CERT`.")
    grpc_tls_server_name: str = Field("", description="Client: the name checked against the server's "
                                      "certificate when it differs from the target's host.")

    @model_validator(mode="after")
    def _pairs_and_files(self) -> GrpcTlsSettings:
        problems = []
        for cert, key in (("grpc_tls_cert", "grpc_tls_key"), ("grpc_tls_client_cert", "grpc_tls_client_key")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                problems.append(f"OPML_{cert.upper()} and OPML_{key.upper()} must be set together")
        if self.grpc_tls_client_ca is not None and self.grpc_tls_cert is None:
            problems.append("OPML_GRPC_TLS_CLIENT_CA (mTLS) needs OPML_GRPC_TLS_CERT and OPML_GRPC_TLS_KEY")
        for name in ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_client_ca", "grpc_tls_ca",
                     "grpc_tls_client_cert", "grpc_tls_client_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                problems.append(f"OPML_{name.upper()} must name a readable PEM file, but {path} is not a file")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def server_tls(self) -> bool:
        return self.grpc_tls_cert is not None

    @property
    def client_tls(self) -> bool:
        return self.grpc_tls_ca is not None


# -------------------------------------------------------------------------------------------------


class PlatformSettings(GrpcTlsSettings):
    """Settings every service shares: where the infrastructure is and how to talk to it."""

    # hide_input_in_errors: a ValidationError never shows the values it read (secrets among them).
    model_config = SettingsConfigDict(env_prefix="OPML_", frozen=True, extra="ignore", hide_input_in_errors=True)

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
    redis_url: str = Field("redis://127.0.0.1:6379/0", repr=False,
                           description="Redis URL for hot state and dedup keys (may hold a password: "
                           "treated as a secret, shown masked).")
    redis_prefix: str = Field("opml:", description="Prepended to every Redis key (tests use a unique one).")
    auth_tokens: SecretStr = Field(
        SecretStr(""),
        description="Bearer tokens, the principal each names and its roles: `name:token=role[+role],...` "
        "(roles: reader, inference, writer, admin; `token=role` names the principal `token:<sha256 prefix>`). "
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

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):  # then mask_url cannot find a password
            raise ValueError("must start with redis://, rediss:// or unix://, but starts with "
                             f"{value.partition(':')[0][:16]!r}")
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

    def tokens(self) -> dict[str, TokenGrant]:
        """The bearer tokens, each with the principal it names and its roles."""
        return parse_tokens(self.auth_tokens.get_secret_value())

    @property
    def redis_url_masked(self) -> str:
        """``redis_url`` with its password replaced by ``***`` (for logs and messages)."""
        return mask_url(self.redis_url)


class ServiceSettings(BaseSettings):
    """Where one service listens. Subclasses set ``env_prefix`` to ``OPML_<SERVICE>_``."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Interface the gRPC and metrics servers bind.")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    shutdown_grace_s: float = Field(5.0, ge=0, description="Seconds in-flight RPCs get on shutdown.")


@dataclass(frozen=True)
class TokenGrant:
    """What one bearer token stands for: the principal's configured name and its roles."""

    name: str
    roles: frozenset[str]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def token_fingerprint(token: str) -> str:
    """The name of a principal configured without one: ``token:`` and 8 hex digits of the token's
    SHA-256 (identifies it in audit logs without revealing any of its characters)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_tokens(spec: str) -> dict[str, TokenGrant]:
    """Parse ``name:token=role+role,token2=role`` into token -> grant; raises ValueError naming the bad
    entry by position (never by its token). A token cannot contain ``:``, ``=`` or ``,``."""
    tokens: dict[str, TokenGrant] = {}
    names: set[str] = set()
    for number, entry in enumerate(filter(None, (part.strip() for part in spec.split(","))), start=1):
        left, sep, roles = entry.partition("=")
        name, colon, token = left.partition(":")
        if not colon:
            name, token = "", left
        if not sep or not token:
            raise ValueError(f"auth_tokens entries must be [name:]token=role[+role], but entry {number} has "
                             + ("no '='" if not sep else "no token"))
        if colon and not _NAME.fullmatch(name):
            raise ValueError(f"auth_tokens entry {number}: a name must be 1-64 letters, digits or _.@- "
                             "starting with a letter or digit")
        role_set = frozenset(filter(None, roles.split("+")))
        unknown = role_set - set(ROLES)
        if not role_set or unknown:
            raise ValueError(f"auth_tokens roles must be among {ROLES}, but entry {number} has "
                             f"{sorted(unknown) or 'none'}")
        name = name or token_fingerprint(token)
        if name in names or token in tokens:
            raise ValueError(f"auth_tokens entry {number} repeats a " + ("token" if token in tokens else "name"))
        names.add(name)
        tokens[token] = TokenGrant(name, role_set)
    return tokens


def mask_url(url: str) -> str:
    """``url`` with the password of its user-info (``redis://user:pw@host``) and a ``password=`` query
    parameter replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        if colon:
            netloc = f"{user}:***@{hostport}"
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))

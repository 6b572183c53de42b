"""bundle-store settings: ``OPML_BUNDLE_STORE_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from opml_bundle_store.core.signing import ManifestKeys
from opml_common.config import ServiceSettings

KEY_FILE_VAR = "OPML_BUNDLE_STORE_MANIFEST_KEY_FILE"
KEYS_VAR = "OPML_BUNDLE_STORE_MANIFEST_KEYS"


class BundleStoreSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_BUNDLE_STORE_", frozen=True, extra="ignore")

    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9151, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "bundle-store",
                       description="Directory holding the service's local contexts, blobs and outbox.")
    transfer_workers: int = Field(32, ge=1, le=256, description="Parallel S3 transfers per push or pull.")
    manifest_key_file: Path | None = Field(
        None, description="File of the keys that sign the manifests this store pushes and verify those it pulls "
        "(HMAC-SHA256; a pull refuses a manifest none of them signed): one a line or comma separated, the first "
        "signs and every one verifies (rotation), each at least 32 characters (`openssl rand -hex 32`). Every "
        "store sharing a remote holds the same keys. With OPML_ENV=prod this or `manifest_keys` is required; "
        "unset in dev, the store makes a key once and keeps it in `home/manifest.key` (mode 0600).")
    manifest_keys: SecretStr = Field(
        SecretStr(""), description="The same keys in the environment, comma separated (`manifest_key_file` keeps "
        "them out of it, and is preferred).")

    @field_validator("manifest_keys")
    @classmethod
    def _keys_are_keys(cls, value: SecretStr) -> SecretStr:
        if value.get_secret_value():
            ManifestKeys.parse(value.get_secret_value())  # names a bad key by position, never shows it
        return value

    @model_validator(mode="after")
    def _one_source_of_keys(self) -> BundleStoreSettings:
        if self.manifest_key_file is not None and self.manifest_keys.get_secret_value():
            raise ValueError(f"set {KEY_FILE_VAR} or {KEYS_VAR}, not both")
        return self

    def manifest_signing_keys(self, env: str) -> ManifestKeys | None:
        """The keys of remote manifests: from the file or the variable; None in dev when neither is
        set (the store keeps a key of its own in its home).

        Raises: ValueError naming the variable (never a key): none set with ``env`` prod, or a key
        file that cannot be read or holds a bad key.
        """
        if self.manifest_key_file is not None:
            try:
                return ManifestKeys.from_file(self.manifest_key_file)
            except (OSError, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                raise ValueError(f"{KEY_FILE_VAR}: {self.manifest_key_file} cannot be used: {reason}") from None
        if self.manifest_keys.get_secret_value():
            return ManifestKeys.parse(self.manifest_keys.get_secret_value())
        if env == "prod":
            raise ValueError(f"{KEY_FILE_VAR} (or {KEYS_VAR}) must be set when OPML_ENV=prod: every store "
                             "sharing a remote signs and verifies its manifests with the same keys")
        return None

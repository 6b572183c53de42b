"""bundle-store settings: ``OPML_BUNDLE_STORE_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from opml_bundle_store.core.grants import GrantKeys
from opml_bundle_store.core.signing import ManifestKeys, SigningKeys
from opml_common.config import ServiceSettings

KEY_FILE_VAR = "OPML_BUNDLE_STORE_MANIFEST_KEY_FILE"
KEYS_VAR = "OPML_BUNDLE_STORE_MANIFEST_KEYS"
GRANT_KEY_FILE_VAR = "OPML_BUNDLE_STORE_GRANT_KEY_FILE"
GRANT_KEYS_VAR = "OPML_BUNDLE_STORE_GRANT_KEYS"
K = TypeVar("K", bound=SigningKeys)


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

    grant_key_file: Path | None = Field(
        None, description="File of the keys that sign the upload grants this store issues (CreateUploadGrant) and "
        "verify those presented to it (HMAC-SHA256): as `manifest_key_file` reads them, the first signs and every "
        "one verifies. Every replica behind one address holds the same keys, so each accepts the others' grants. "
        "With OPML_ENV=prod this or `grant_keys` is required; unset in dev, the store makes a key once and keeps "
        "it in `home/grant.key` (mode 0600). Keep it apart from the manifest keys.")
    grant_keys: SecretStr = Field(SecretStr(""), description="The same keys in the environment, comma separated "
                                  "(`grant_key_file` keeps them out of it, and is preferred).")
    max_grant_bytes: int = Field(4 * 1024**3, ge=1, description="The largest `max_bytes` an upload grant may "
                                 "allow (one upload's declared files together).")
    shared_contexts: dict[str, str] = Field(
        {}, description="Contexts this store serves as one of several replicas, as JSON "
        "`{\"context\": \"s3://bucket/prefix\"}`: each is made (or bound to that remote) at start, and its remote "
        "is the truth for its committed bundles: a commit is pushed before it returns, and reads merge the "
        "remote's manifests (a list, a name's latest, a uuid held by another replica; files fetched when read). "
        "Every replica lists the same contexts and holds the same manifest keys. Uncommitted bundles are staged "
        "there too, so any replica reads or commits what another received.")
    staging_ttl_s: int = Field(7 * 86400, ge=1, le=10 * 365 * 86400, description="A shared context's uncommitted "
                               "bundle staged on its remote for longer than this is abandoned: a remote gc (`gc "
                               "--remote`) removes it, then its blobs after their grace. At least the longest upload "
                               "grant (7 days) plus the time its issuer takes to commit.")

    @field_validator("manifest_keys", "grant_keys")
    @classmethod
    def _keys_are_keys(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        if value.get_secret_value():  # names a bad key by position, never shows it
            (GrantKeys if info.field_name == "grant_keys" else ManifestKeys).parse(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _one_source_of_keys(self) -> BundleStoreSettings:
        if self.manifest_key_file is not None and self.manifest_keys.get_secret_value():
            raise ValueError(f"set {KEY_FILE_VAR} or {KEYS_VAR}, not both")
        if self.grant_key_file is not None and self.grant_keys.get_secret_value():
            raise ValueError(f"set {GRANT_KEY_FILE_VAR} or {GRANT_KEYS_VAR}, not both")
        return self

    def upload_grant_keys(self, env: str) -> GrantKeys | None:
        """The keys of upload grants, as :meth:`manifest_signing_keys` reads the manifest keys (None in
        dev when neither is set: the store keeps a key of its own in its home).

        Raises: ValueError naming the variable (never a key).
        """
        return _keys(GrantKeys, self.grant_key_file, self.grant_keys, env, GRANT_KEY_FILE_VAR, GRANT_KEYS_VAR,
                     "every replica signs and verifies upload grants with the same keys")

    def manifest_signing_keys(self, env: str) -> ManifestKeys | None:
        """The keys of remote manifests: from the file or the variable; None in dev when neither is
        set (the store keeps a key of its own in its home).

        Raises: ValueError naming the variable (never a key): none set with ``env`` prod, or a key
        file that cannot be read or holds a bad key.
        """
        return _keys(ManifestKeys, self.manifest_key_file, self.manifest_keys, env, KEY_FILE_VAR, KEYS_VAR,
                     "every store sharing a remote signs and verifies its manifests with the same keys")


def _keys(kind: type[K], key_file: Path | None, keys: SecretStr, env: str, file_var: str, keys_var: str,
          why: str) -> K | None:
    if key_file is not None:
        try:
            return kind.from_file(key_file)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ValueError(f"{file_var}: {key_file} cannot be used: {reason}") from None
    if keys.get_secret_value():
        return kind.parse(keys.get_secret_value())
    if env == "prod":
        raise ValueError(f"{file_var} (or {keys_var}) must be set when OPML_ENV=prod: {why}")
    return None

"""Fixtures: a real bundle-store process on free ports, wired to the session's real infrastructure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from opml_bundle_store.client import BundleStoreClient
from opml_common.devinfra import free_port
from opml_common.process import ServiceProcess

TOKENS = {"admin": "admin-token", "writer": "writer-token", "reader": "reader-token"}


@pytest.fixture
def bundle_store(settings_env: dict[str, str], tmp_path: Path) -> Iterator[ServiceProcess]:
    """A running bundle-store service with auth on (tokens in TOKENS), stopped after the test."""
    port = free_port()
    env = {
        **settings_env,
        "OPML_BUNDLE_STORE_HOME": str(tmp_path / "home"),
        "OPML_BUNDLE_STORE_GRPC_PORT": str(port),
        "OPML_BUNDLE_STORE_METRICS_PORT": str(free_port()),
        "OPML_AUTH_TOKENS": ",".join(f"{token}={role}" for role, token in TOKENS.items()),
    }
    process = ServiceProcess("opml_bundle_store", port, env, tmp_path / "bundle-store.log")
    with process:
        yield process


@pytest.fixture
def tokens() -> dict[str, str]:
    """Bearer token of each role the bundle_store fixture accepts."""
    return dict(TOKENS)


@pytest.fixture
def admin(bundle_store: ServiceProcess) -> Iterator[BundleStoreClient]:
    with BundleStoreClient(bundle_store.target, token=TOKENS["admin"]) as client:
        yield client


@pytest.fixture
def writer(bundle_store: ServiceProcess) -> Iterator[BundleStoreClient]:
    with BundleStoreClient(bundle_store.target, token=TOKENS["writer"]) as client:
        yield client


@pytest.fixture
def remote_url(unique_prefix: str) -> str:
    """An S3 remote URL in a bucket unique to this test."""
    return f"s3://{unique_prefix.rstrip('-')}/contexts"

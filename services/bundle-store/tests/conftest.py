"""Fixtures: a real bundle-store process on free ports, wired to the session's real infrastructure."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter


@pytest.fixture
def bundle_store(start_service: ServiceStarter) -> ServiceProcess:
    """A running bundle-store service with auth on (the plugin's ``tokens``), stopped after the test."""
    return start_service("bundle-store")


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

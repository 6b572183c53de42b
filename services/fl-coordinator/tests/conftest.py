"""Fixtures of the fl-coordinator's service tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator_contract.client import FederationClient

PROGRAMS = Path(__file__).parent / "programs"
sys.path.insert(0, str(PROGRAMS))  # the member program doubles as the threads' member class


@pytest.fixture
def coordinator(start_service):
    """Messages of at most 256 KiB: models larger than that only move because they move in chunks."""
    return start_service("fl-coordinator", extra_env={"OPML_FL_COORDINATOR_GRPC_MAX_RECEIVE_BYTES": "262144",
                                                      "OPML_FL_COORDINATOR_CHUNK_BYTES": "131072"})


@pytest.fixture
def writer(coordinator):
    with FederationClient(coordinator.target, token=TOKENS["writer"]) as client:
        yield client

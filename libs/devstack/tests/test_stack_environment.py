"""The environment `make up` gives the installed services: every service that reads or commits bundles
finds the stack's bundle-store through it, so no flow stops at a service that was never told where it is."""

from __future__ import annotations

import pytest

from opml_devstack import stack
from opml_devstack.devinfra import Endpoints

ENDPOINTS = Endpoints(kafka_bootstrap="127.0.0.1:19092", s3_endpoint="http://127.0.0.1:18333", s3_access_key="a",
                      s3_secret_key="b", redis_url="redis://127.0.0.1:16379/0")
# The services whose flows go through the bundle-store: none may be left out of the check below.
BUNDLE_USERS = {"automl-controller", "fl-coordinator", "inference-router", "monitoring-scorer"}


def test_every_service_with_a_bundle_store_target_gets_the_stacks_bundle_store(monkeypatch, tmp_path) -> None:
    specs = stack.installed_services()
    for spec in specs:  # what the test's own environment sets must not stand in for the stack's
        monkeypatch.delenv(f"{spec.env_prefix}BUNDLE_STORE_TARGET", raising=False)
    env, _ = stack.service_environment(specs, ENDPOINTS, stack.StackConfig(state_dir=tmp_path, homes=tmp_path))
    store = env["OPML_BUNDLE_STORE_TARGET"]
    users = {spec.name for spec in specs if "bundle_store_target" in spec.settings.model_fields}
    assert users >= BUNDLE_USERS
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    wrong = {spec.name: spec.settings().bundle_store_target for spec in specs if spec.name in users
             and spec.settings().bundle_store_target != store}
    assert not wrong, f"the stack's bundle-store is {store}, but these services would use {wrong}"


@pytest.mark.parametrize("name", sorted(BUNDLE_USERS))
def test_a_services_own_bundle_store_target_wins_over_the_platforms(name, monkeypatch) -> None:
    (spec,) = [spec for spec in stack.installed_services() if spec.name == name]
    monkeypatch.setenv("OPML_BUNDLE_STORE_TARGET", "platform:1")
    monkeypatch.setenv(f"{spec.env_prefix}BUNDLE_STORE_TARGET", "own:2")
    assert spec.settings().bundle_store_target == "own:2"


def test_the_automl_controller_finds_the_stacks_orchestrator_and_router(monkeypatch, tmp_path) -> None:
    """Its trials' jobs go to the stack's orchestrator, and ServingConfigSurrogate trials are the stack's
    router's predictions (unset, such experiments would be refused under `make up`)."""
    specs = stack.installed_services()
    (automl,) = [spec for spec in specs if spec.name == "automl-controller"]
    for name in ("JOB_ORCHESTRATOR_TARGET", "INFERENCE_ROUTER_TARGET", "BUNDLE_STORE_TARGET"):
        monkeypatch.delenv(f"{automl.env_prefix}{name}", raising=False)
    env, _ = stack.service_environment(specs, ENDPOINTS, stack.StackConfig(state_dir=tmp_path, homes=tmp_path,
                                                                          free_ports=True))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = automl.settings()
    assert (settings.job_orchestrator_target, settings.inference_router_target, settings.bundle_store_target) == (
        env["OPML_JOB_ORCHESTRATOR_TARGET"], env["OPML_INFERENCE_ROUTER_TARGET"], env["OPML_BUNDLE_STORE_TARGET"])

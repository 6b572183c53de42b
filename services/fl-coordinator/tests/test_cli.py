"""``opml fl`` against the real service: create from a file, ls, rounds, register, stop, plot."""

from __future__ import annotations

import pytest

CONFIG = "name: cli\nrounds: 2\nmin_clients: 1\nselection: {clients_per_round: 1}\n"


def test_the_cli_creates_lists_registers_and_stops(coordinator, opml_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("OPML_FL_COORDINATOR_TARGET", coordinator.target)
    path = tmp_path / "fed.yaml"
    path.write_text(CONFIG)
    assert "created federations/cli (waiting), 2 rounds" in opml_cli("fl", "create", "-f", str(path))
    assert "cli" in opml_cli("fl", "ls", token="reader")
    token = opml_cli("fl", "register", "cli", "plant-1").strip()
    assert token.startswith("flc_") and len(token) > 40
    assert "stopped" in opml_cli("fl", "stop", "cli")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: cli\nrounds: 0\nstrategy: {name: fedadam, eta: -1}\n")
    out = opml_cli("fl", "create", "-f", str(bad), expect_exit=1)
    assert "rounds" in out and "strategy.eta" in out


@pytest.mark.parametrize("command", [("fl", "rounds", "nope"), ("fl", "plot", "nope", "-o", "x.png")])
def test_unknown_federations_are_named(coordinator, opml_cli, monkeypatch, command):
    monkeypatch.setenv("OPML_FL_COORDINATOR_TARGET", coordinator.target)
    assert "nope" in opml_cli(*command, token="reader", expect_exit=1)


def test_rounds_and_the_accuracy_plot_of_a_finished_federation(coordinator, writer, opml_cli, tmp_path, monkeypatch):
    from member import DigitsMember

    from opml_devstack.testing.services import TOKENS
    from opml_fl_coordinator_contract.client import run_client

    monkeypatch.setenv("OPML_FL_COORDINATOR_TARGET", coordinator.target)
    writer.create(CONFIG.replace("name: cli", "name: plotted"))
    token = writer.register_client("plotted", "solo").token
    run_client(coordinator.target, "plotted", token, DigitsMember(0, 2), token=TOKENS["reader"], wait_s=2.0)
    lines = opml_cli("fl", "rounds", "plotted", token="reader").splitlines()
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"] and "solo" in lines[0]
    png = tmp_path / "accuracy.png"
    assert "2 rounds" in opml_cli("fl", "plot", "plotted", "-o", str(png), token="reader")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

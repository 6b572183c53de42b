"""`make up` over the installed services: one package that does not load keeps none of the others down."""

from __future__ import annotations

from importlib.metadata import EntryPoint

from opml_devstack import stack


def test_a_service_whose_package_does_not_load_is_reported_and_the_others_start(monkeypatch) -> None:
    good = EntryPoint("bundle-store", "opml_bundle_store.__main__", "opml.services")
    broken = EntryPoint("half-installed", "opml_no_such_service_package.__main__", "opml.services")
    monkeypatch.setattr(stack, "entry_points", lambda group: [broken, good] if group == "opml.services" else [])
    specs, unloadable = stack.loadable_services()
    assert [spec.name for spec in specs] == ["bundle-store"]
    assert unloadable == {"half-installed": "ModuleNotFoundError: No module named 'opml_no_such_service_package'"}


def test_status_is_not_ok_while_an_installed_service_did_not_load(tmp_path, monkeypatch) -> None:
    state = stack.StackConfig(state_dir=tmp_path)
    stack.write_json_atomically(state.state_file, {"pid": 1, "parts": [], "unloadable": {"x": "ImportError: y"}})
    monkeypatch.setattr(stack, "_alive", lambda pid: True)
    document = stack.status(tmp_path)
    assert document["running"] and not document["ok"] and document["unloadable"] == {"x": "ImportError: y"}

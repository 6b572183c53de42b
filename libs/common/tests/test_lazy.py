"""lazy_exports: a package's names imported from their submodules on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_a_name_is_imported_on_first_use_only() -> None:
    code = ("import sys\n"
            "import opml_common.perfmodel as p\n"
            "assert 'opml_common.perfmodel.learn' not in sys.modules\n"
            "assert p.ServingConfig.__module__ == 'opml_common.perfmodel.space'\n"
            "assert 'sklearn' not in sys.modules\n"
            "assert p.PerformanceModel.__module__ == 'opml_common.perfmodel.learn'\n"
            "assert 'PerformanceModel' in vars(p)\n")  # kept in the namespace after the first read
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_unknown_name_is_an_attribute_error() -> None:
    import opml_common.perfmodel as perfmodel

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        perfmodel.Nope  # noqa: B018


def test_every_exported_name_resolves() -> None:
    import opml_common.perfmodel as perfmodel

    assert all(getattr(perfmodel, name) is not None for name in perfmodel.__all__)

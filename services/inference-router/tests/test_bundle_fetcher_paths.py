"""The router's bundle fetcher, handed escaping paths by a hostile bundle-store, writes nothing outside its home."""

from __future__ import annotations

from pathlib import Path

import pytest

from opml_bundle_store_contract.testing import HostileStore, files_under, serving
from opml_common.errors import DataLoss
from opml_inference_router.control.bundles import BundleFetcher
from opml_inference_router.control.state import Source


async def test_inference_router_bundle_fetcher_refuses(tmp_path: Path) -> None:
    home = tmp_path / "router" / "home"
    home.mkdir(parents=True)
    with serving(HostileStore(["../../../../x"])) as target:
        fetcher = BundleFetcher(target, home)
        try:
            with pytest.raises(DataLoss, match=r"'\.\./\.\./\.\./\.\./x'"):
                await fetcher.fetch(Source(context="lab", bundle="model"))
        finally:
            await fetcher.close()
    assert files_under(tmp_path) == set()


import pytest

from opml_common.errors import InvalidArgument
from opml_common.pagination import cursor_token, page_size_of, paginate, read_cursor


def test_pages_cover_every_item_once() -> None:
    items, seen, token = list(range(25)), [], ""
    while True:
        page, token = paginate(items, 10, token, query="q")
        seen.extend(page)
        if not token:
            break
    assert seen == items


def test_default_and_cap() -> None:
    assert len(paginate(list(range(500)), 0, "")[0]) == 100
    assert len(paginate(list(range(5000)), 10_000, "")[0]) == 1000


def test_bad_size_and_tokens_name_the_field() -> None:
    with pytest.raises(InvalidArgument) as caught:
        paginate([1], -5, "")
    assert caught.value.field == "page_size" and "-5" in caught.value.message
    with pytest.raises(InvalidArgument, match="page_token"):
        paginate([1], 1, "not-a-token")
    _, token = paginate([1, 2], 1, "", query="a")
    with pytest.raises(InvalidArgument, match="other filters"):
        paginate([1, 2], 1, token, query="b")


def test_a_cursor_comes_back_as_it_went_and_only_for_its_filters() -> None:
    token = cursor_token((-7, "m", "2", "drift"), "models/m")
    assert read_cursor(token, (int, str, str, str), "models/m") == (-7, "m", "2", "drift")
    with pytest.raises(InvalidArgument, match="other filters"):
        read_cursor(token, (int, str, str, str), "models/n")
    for bad in ("not-a-token", cursor_token(("7", "m", "2", "drift"), "models/m"), cursor_token((1,), "models/m")):
        with pytest.raises(InvalidArgument) as caught:
            read_cursor(bad, (int, str, str, str), "models/m")
        assert caught.value.field == "page_token"
    assert (page_size_of(0), page_size_of(5000, max_size=1000)) == (100, 1000)

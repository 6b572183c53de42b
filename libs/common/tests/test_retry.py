import pytest

from opml_common.errors import InvalidArgument
from opml_common.retry import Backoff


def test_doubles_up_to_the_cap() -> None:
    backoff = Backoff(base_s=0.5, max_s=3.0)
    assert [backoff.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert Backoff(base_s=0.0, max_s=1.0).delay(10) == 0.0
    assert Backoff(base_s=1.0, max_s=1e9, multiplier=3).delay(3) == 27.0


@pytest.mark.parametrize("kwargs, field", [
    ({"base_s": -1, "max_s": 1}, "base_s"),
    ({"base_s": 2, "max_s": 1}, "max_s"),
    ({"base_s": 1, "max_s": 2, "multiplier": 0.5}, "multiplier"),
])
def test_bad_settings_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Backoff(**kwargs)
    assert caught.value.field == field

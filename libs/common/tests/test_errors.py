import pytest

from opml_common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OpmlError,
    Unavailable,
    from_status,
)


@pytest.mark.parametrize("error", [NotFound("bundle x not found"), FailedPrecondition("no remote"),
                                   DataLoss("blob corrupt"), Unavailable("s3 down")])
def test_errors_survive_the_wire(error: OpmlError) -> None:
    back = from_status(error.code, error.message)
    assert type(back) is type(error) and back.message == error.message and back.retriable == error.retriable


def test_invalid_argument_keeps_its_field() -> None:
    back = from_status("INVALID_ARGUMENT", InvalidArgument("page_size", "must be >= 0, but got -5").message)
    assert isinstance(back, InvalidArgument) and back.field == "page_size"

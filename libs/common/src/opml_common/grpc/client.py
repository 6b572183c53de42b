"""Client side of the platform's gRPC APIs: channels with bearer tokens, and errors back as domain types."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from opml_common.errors import OpmlError, Unavailable, from_status

T = TypeVar("T")


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def open_channel(target: str, *, token: str | None = None, tls: bool = False) -> grpc.Channel:
    """A channel to ``target`` (host:port) that sends ``token`` as a bearer token on every call."""
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
               ("grpc.max_send_message_length", 64 * 1024 * 1024)]
    channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=options) if tls
               else grpc.insecure_channel(target, options=options))
    return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel


def domain_error(error: grpc.RpcError) -> OpmlError:
    """The domain error that a server's status code and message stand for."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(error.details() or code.name)
    return from_status(code.name, error.details() or "")


def raising_domain_errors(call: Callable[..., T]) -> Callable[..., T]:
    """Decorate a client method so a failed RPC raises OpmlError subclasses, never grpc.RpcError."""
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except grpc.RpcError as error:
            raise domain_error(error) from None
    return wrapper


def stream_raising_domain_errors(stream: Iterator[T]) -> Iterator[T]:
    """Iterate a server stream, turning a failed RPC into an OpmlError."""
    try:
        yield from stream
    except grpc.RpcError as error:
        raise domain_error(error) from None

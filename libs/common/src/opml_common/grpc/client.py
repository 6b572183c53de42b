"""Client side of the platform's gRPC APIs: channels with bearer tokens, and errors back as domain types.

Every channel the platform opens (clients, service-to-service calls, the CLI, health probes) takes its
TLS settings from ``OPML_GRPC_TLS_*`` (:class:`~opml_common.config.GrpcTlsSettings`) unless told
otherwise: with ``OPML_GRPC_TLS_CA`` set it connects with TLS and checks the server's certificate
against that CA, presenting ``OPML_GRPC_TLS_CLIENT_CERT``/``_KEY`` when set (mTLS).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Self, TypeVar

import grpc

from opml_common.config import GrpcTlsSettings
from opml_common.errors import OpmlError, from_status
from opml_common.grpc.status import field_violations

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


Tls = GrpcTlsSettings | bool | None
"""How a channel secures itself: settings; True (TLS against the system's roots); False (plaintext);
None (read ``OPML_GRPC_TLS_*`` from the environment)."""


def tls_settings(env: Mapping[str, str] | None = None) -> GrpcTlsSettings:
    """``OPML_GRPC_TLS_*`` read from ``env`` (default: this process's environment), e.g. to probe a
    child process started with its own environment."""
    if env is None:
        return GrpcTlsSettings()
    given = {name: env[f"OPML_{name.upper()}"] for name in GrpcTlsSettings.model_fields
             if f"OPML_{name.upper()}" in env}
    return GrpcTlsSettings(**given)


def channel_security(tls: Tls = None) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """The credentials (None: plaintext) and channel options a client channel needs for ``tls``."""
    if tls is None:
        tls = tls_settings()
    if tls is True:
        return grpc.ssl_channel_credentials(), []
    if tls is False or not tls.client_tls:
        return None, []
    key = tls.grpc_tls_client_key.read_bytes() if tls.grpc_tls_client_key is not None else None
    chain = tls.grpc_tls_client_cert.read_bytes() if tls.grpc_tls_client_cert is not None else None
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.grpc_tls_ca.read_bytes(),
                                               private_key=key, certificate_chain=chain)
    options = [("grpc.ssl_target_name_override", tls.grpc_tls_server_name)] if tls.grpc_tls_server_name else []
    return credentials, options


MESSAGE_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def open_channel(target: str, *, token: str | None = None, tls: Tls = None,
                 options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A channel to ``target`` (host:port) that sends ``token`` as a bearer token on every call,
    secured as ``tls`` says (default: from ``OPML_GRPC_TLS_*``)."""
    credentials, tls_options = channel_security(tls)
    options = [*(MESSAGE_OPTIONS if options is None else options), *tls_options]
    channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(target, options=options))
    return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel


def open_aio_channel(target: str, *, tls: Tls = None,
                     options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``, secured as ``tls`` says (default: from ``OPML_GRPC_TLS_*``)."""
    credentials, tls_options = channel_security(tls)
    options = [*(MESSAGE_OPTIONS if options is None else options), *tls_options]
    return (grpc.aio.secure_channel(target, credentials, options=options) if credentials is not None
            else grpc.aio.insecure_channel(target, options=options))


def domain_error(error: grpc.RpcError) -> OpmlError:
    """The domain error that a server's status code and message stand for: a call past its deadline is
    DeadlineExceeded and an unreachable server Unavailable (both retriable), so a caller tells a slow
    answer from an outage."""
    code = error.code()
    return from_status(code.name, error.details() or code.name, field_violations(error))


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


class _DomainErrorStub:
    """A generated stub whose every call raises OpmlError subclasses instead of grpc.RpcError
    (server streams included, when they are read), so no client method needs its own wrapper."""

    def __init__(self, stub: object) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                result = method(*args, **kwargs)
            except grpc.RpcError as error:
                raise domain_error(error) from None
            return stream_raising_domain_errors(result) if isinstance(result, Iterator) else result

        setattr(self, name, call)  # looked up once per method
        return call


class ServiceClient:
    """Base of the platform's blocking Python clients: one channel with the bearer token, the
    service's stub as ``self.stub`` (its failures raise domain errors), ``close()`` and ``with``.

    A subclass sets ``stub_class`` and adds one method per RPC that builds the request and returns
    the reply; list methods use :func:`pages`.
    """

    stub_class: ClassVar[Callable[[grpc.Channel], object]]

    def __init__(self, target: str, *, token: str | None = None, tls: Tls = None) -> None:
        self.target = target
        self._channel = open_channel(target, token=token, tls=tls)
        self.stub = _DomainErrorStub(self.stub_class(self._channel))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AioDomainErrorStub:
    """A generated grpc.aio stub whose every call sends the bearer token and raises OpmlError subclasses
    instead of grpc.RpcError (server streams included, when they are read). A call the client's closing
    cut short raises OpmlError, as a blocking client's does, not a cancellation of the caller's task."""

    def __init__(self, stub: object, metadata: tuple[tuple[str, str], ...], closed: Callable[[], bool]) -> None:
        self._stub, self._metadata, self._closed = stub, metadata, closed

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)
        streams = isinstance(method, (grpc.aio.UnaryStreamMultiCallable, grpc.aio.StreamStreamMultiCallable))

        def start(args: tuple, kwargs: dict) -> Any:
            metadata = (*(kwargs.pop("metadata", None) or ()), *self._metadata)
            return method(*args, metadata=metadata, **kwargs)

        if streams:
            @functools.wraps(method)
            def call(*args, **kwargs):
                return self._read(start(args, kwargs))
        else:
            @functools.wraps(method)
            async def call(*args, **kwargs):
                try:
                    return await start(args, kwargs)
                except grpc.RpcError as error:
                    raise domain_error(error) from None
                except asyncio.CancelledError:
                    self._raise_if_closed()
                    raise

        setattr(self, name, call)  # looked up once per method
        return call

    async def _read(self, stream: Any) -> AsyncIterator[Any]:
        try:
            async for item in stream:
                yield item
        except grpc.RpcError as error:
            raise domain_error(error) from None
        except asyncio.CancelledError:
            self._raise_if_closed()
            raise
        finally:
            stream.cancel()  # a reader that stops early ends the call (a no-op once it has ended)

    def _raise_if_closed(self) -> None:
        task = asyncio.current_task()
        if self._closed() and (task is None or not task.cancelling()):
            raise from_status("CANCELLED", "the client was closed during the call") from None


class AsyncServiceClient:
    """Base of the platform's asyncio clients (grpc.aio), for a service that calls another from its
    event loop: no blocking channel on a worker thread beside the service's own grpc.aio server (a mix
    gRPC has crashed on), no thread per call. As :class:`ServiceClient`: one channel (TLS from
    ``OPML_GRPC_TLS_*`` unless ``tls`` says), the bearer token on every call, the stub as ``self.stub``
    (its failures raise domain errors); ``await close()`` or ``async with``. Made on the loop that uses it.

    A subclass sets ``stub_class`` and adds one coroutine per RPC; list methods use :func:`async_pages`.
    """

    stub_class: ClassVar[Callable[[grpc.aio.Channel], object]]

    def __init__(self, target: str, *, token: str | None = None, tls: Tls = None) -> None:
        self.target = target
        self._channel = open_aio_channel(target, tls=tls)
        self._closed = False
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = _AioDomainErrorStub(self.stub_class(self._channel), metadata, lambda: self._closed)

    async def close(self) -> None:
        """Close the channel; calls still in flight end with OpmlError."""
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


R = TypeVar("R")


def pages(call: Callable[[str], R], items: Callable[[R], Iterable[T]]) -> Iterator[T]:
    """Every item of a paginated List RPC (AIP-158): ``call(page_token)`` returns one page, whose
    ``next_page_token`` is empty on the last; ``items(reply)`` picks the page's items."""
    token = ""
    while True:
        reply = call(token)
        yield from items(reply)
        token = reply.next_page_token  # type: ignore[attr-defined]
        if not token:
            return


async def async_pages(call: Callable[[str], Awaitable[R]], items: Callable[[R], Iterable[T]]) -> AsyncIterator[T]:
    """:func:`pages` for an asyncio client: ``await call(page_token)`` returns one page."""
    token = ""
    while True:
        reply = await call(token)
        for item in items(reply):
            yield item
        token = reply.next_page_token  # type: ignore[attr-defined]
        if not token:
            return

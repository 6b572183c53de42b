"""Server interceptors: who is calling (auth), and what became of each call (status, metrics, logs).

Both wrap the method handler instead of adding flags to servicers. ``ObservabilityInterceptor`` is
the one place where domain errors become status codes (as KServe does): ``OpmlError`` subclasses
map to their code with their message; anything else is INTERNAL with a generic message and the
traceback logged, so internals never leak to callers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
import redis.exceptions
from grpc.aio import AbortError

from opml_common.config import ROLES, TokenGrant
from opml_common.errors import OpmlError, Unauthenticated
from opml_common.grpc.status import trailing_details, wire_message
from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}  # reader < inference < writer < admin
AUDITED_ROLES = frozenset({"writer", "admin"})  # calls needing these are logged at INFO even when OK


@dataclass(frozen=True)
class Scope:
    """What a scoped bearer token (one a service issues itself, e.g. an upload grant) allows beyond its
    roles: only ``methods`` (short names, ``AddBundle``), each call then checked by the servicer against
    ``grant`` (the service's own description of what the token allows). ``what`` names the token in
    messages and audit logs (its id, never the token)."""

    what: str
    methods: frozenset[str]
    grant: object


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of the current RPC; ``scope`` restricts a scoped token's holder."""

    name: str
    roles: frozenset[str]
    scope: Scope | None = None

    def has(self, role: str) -> bool:
        return any(ROLE_RANK[r] >= ROLE_RANK[role] for r in self.roles)


ANONYMOUS_ADMIN = Principal("anonymous", frozenset({"admin"}))
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("opml_principal", default=ANONYMOUS_ADMIN)


def current_principal() -> Principal:
    """The caller of the RPC being handled (for lineage's creator, audit logs)."""
    return _principal.get()


# The call record of the RPC being handled (set by ObservabilityInterceptor, which runs outside the
# auth interceptor): auth writes the caller and the role the method needs on it, so the audit line
# written when the call ends names the real caller, even after the principal's contextvar is reset.
_call_record: contextvars.ContextVar[_CallRecord | None] = contextvars.ContextVar("opml_call_record",
                                                                                   default=None)


def _note_caller(principal: Principal | None, needed: str | None) -> None:
    record = _call_record.get()
    if record is not None:
        record.principal, record.needed = principal, needed


Behavior = Callable[..., object]


def _wrap(handler: grpc.RpcMethodHandler, around: Callable[[Behavior, bool], Behavior]) -> grpc.RpcMethodHandler:
    """Return ``handler`` with its behavior replaced by ``around(behavior, streaming_response)``."""
    for kind, factory in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return factory(
                around(behavior, kind.endswith("_stream")),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _method_name(full_method: str) -> str:
    return full_method.rsplit("/", 1)[-1]


UNAUTHENTICATED_MESSAGE = "missing or unknown bearer token (send 'authorization: Bearer <token>')"


def bearer_principal(tokens: Mapping[str, TokenGrant], authorization: str) -> Principal | None:
    """The caller an ``authorization`` header value names (``Bearer <token>``), or None when it is
    missing, of another scheme or an unknown token. Every server that takes calls checks them here."""
    scheme, _, token = authorization.partition(" ")
    grant = tokens.get(token) if scheme.lower() == "bearer" else None
    return None if grant is None else Principal(grant.name, grant.roles)


def missing_role_message(method: str, needed: str, principal: Principal) -> str:
    return f"{method} needs the {needed} role; the caller has {sorted(principal.roles)}"


TokenVerifier = Callable[[str], Principal | None]
"""Maps a bearer token the configured tokens do not know to the scoped :class:`Principal` it stands for,
or None when it is no token of the verifier's kind. It raises
:class:`~opml_common.errors.Unauthenticated` for a token of its kind that does not verify (tampered,
expired), with a message that never quotes the token."""


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def out_of_scope_message(method: str, scope: Scope) -> str:
    return (f"{method} is not allowed with {scope.what}; it allows only "
            f"{', '.join(sorted(scope.methods))}")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth with roles (reader < inference < writer < admin).

    ``tokens`` maps each bearer token to its :class:`~opml_common.config.TokenGrant` (the principal's
    configured name and roles), as ``PlatformSettings.tokens()`` returns it.

    ``method_roles`` maps a full method (``/opml.bundles.v1.BundleStore/DeleteBundle``) to the role it
    needs; the server checks at start-up that every RPC it hosts is listed (see
    :class:`~opml_common.grpc.server.ServiceRegistration`), and any other needs ``default_role``.
    With no tokens configured (dev), every caller is an anonymous admin. Health and reflection are
    always open so probes and tools work.

    ``token_verifier`` (:data:`TokenVerifier`) knows the scoped tokens a service issues itself: a
    bearer token the configured ones do not know is given to it, and the :class:`Principal` it returns
    may call only its scope's methods (PERMISSION_DENIED naming them otherwise); the servicer checks the
    rest of the scope. A presented scoped token always restricts its holder, with tokens configured or
    not (dev): whoever holds one was handed it to do that one thing. Scoped principals are not cached
    (each call checks the token's expiry again).
    """

    OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

    def __init__(self, tokens: Mapping[str, TokenGrant], *, method_roles: Mapping[str, str],
                 default_role: str = "writer", token_verifier: TokenVerifier | None = None) -> None:
        unknown = {r for r in (*method_roles.values(), default_role) if r not in ROLE_RANK}
        if unknown:
            raise ValueError(f"method_roles must use roles {sorted(ROLE_RANK)}, but got {sorted(unknown)}")
        self._tokens = dict(tokens)
        self._method_roles = dict(method_roles)
        self._default_role = default_role
        self._token_verifier = token_verifier
        # (method, token) -> (handler, wrapped): tokens and methods are few, and wrapping per call
        # costs more than the rest of the check.
        self._wrapped: dict[tuple[str, str], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN_PREFIXES):
            return handler
        if not self._tokens and self._token_verifier is None:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = str(metadata.get("authorization", ""))
        principal = bearer_principal(self._tokens, authorization)
        method = _method_name(handler_call_details.method)
        needed = self._method_roles.get(handler_call_details.method, self._default_role)
        if principal is None and self._token_verifier is not None and (token := _bearer(authorization)):
            try:
                principal = self._token_verifier(token)
            except Unauthenticated as error:
                return _wrap(handler, _reject(grpc.StatusCode.UNAUTHENTICATED, error.message, None, needed))
            if principal is not None:
                return self._scoped(handler, method, needed, principal)
        if principal is None and not self._tokens:
            return handler  # dev: no token configured, and no scoped token presented
        if principal is None:
            return _wrap(handler, _reject(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, None, needed))
        cached = self._wrapped.get((handler_call_details.method, authorization))
        if cached is not None and cached[0] is handler:
            return cached[1]
        if not principal.has(needed):
            wrapped = _wrap(handler, _reject(grpc.StatusCode.PERMISSION_DENIED,
                                             missing_role_message(method, needed, principal), principal, needed))
        else:
            wrapped = _wrap(handler, _with_principal(principal, needed))
        self._wrapped[(handler_call_details.method, authorization)] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _scoped(handler: grpc.RpcMethodHandler, method: str, needed: str,
                principal: Principal) -> grpc.RpcMethodHandler:
        scope = principal.scope
        if scope is not None and method not in scope.methods:
            return _wrap(handler, _reject(grpc.StatusCode.PERMISSION_DENIED, out_of_scope_message(method, scope),
                                          principal, needed))
        if not principal.has(needed):
            return _wrap(handler, _reject(grpc.StatusCode.PERMISSION_DENIED,
                                          missing_role_message(method, needed, principal), principal, needed))
        return _wrap(handler, _with_principal(principal, needed))


def _reject(code: grpc.StatusCode, message: str, principal: Principal | None,
            needed: str) -> Callable[[Behavior, bool], Behavior]:
    def around(_behavior: Behavior, streaming: bool) -> Behavior:
        if streaming:
            async def reject_stream(_request, context):
                _note_caller(principal or UNAUTHENTICATED, needed)
                await context.abort(code, message)
                yield  # pragma: no cover - makes this an async generator
            return reject_stream

        async def reject(_request, context):
            _note_caller(principal or UNAUTHENTICATED, needed)
            await context.abort(code, message)
        return reject
    return around


UNAUTHENTICATED = Principal("unauthenticated", frozenset())  # the audit name of a call with no valid token


def _with_principal(principal: Principal, needed: str) -> Callable[[Behavior, bool], Behavior]:
    def around(behavior: Behavior, streaming: bool) -> Behavior:
        if streaming:
            async def stream(request, context):
                _note_caller(principal, needed)
                token = _principal.set(principal)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    _principal.reset(token)
            return stream

        async def unary(request, context):
            _note_caller(principal, needed)
            token = _principal.set(principal)
            try:
                return await behavior(request, context)
            finally:
                _principal.reset(token)
        return unary
    return around


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):
    """RED metrics and a log line per RPC, and the mapping of domain errors to status codes."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._requests = metrics.counter("grpc_requests_total", "RPCs handled, by method and status code.",
                                         ("method", "code"))
        self._duration = metrics.histogram("grpc_request_duration_seconds", "RPC duration.", ("method",))
        self._in_flight = metrics.gauge("grpc_requests_in_flight", "RPCs being handled.", ("method",))
        # full method -> (handler, wrapped): the wrapping and the labelled metric children are made
        # once per method, not per call (they cost tens of microseconds on a hot path).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._method_metrics: dict[str, _MethodMetrics] = {}

    def declare(self, full_methods: Iterable[str]) -> None:
        """Make each method's series exist at 0 before its first call (code OK, in flight, duration), so
        a rate over a method called once, or not yet, reads 0 on a dashboard instead of no data."""
        for full_method in full_methods:
            self._method_metrics.setdefault(full_method, _MethodMetrics(self, _method_name(full_method))).declare()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        full_method = handler_call_details.method
        cached = self._wrapped.get(full_method)
        if cached is None or cached[0] is not handler:
            metrics = self._method_metrics.setdefault(full_method, _MethodMetrics(self, _method_name(full_method)))
            cached = (handler, _wrap(handler, self._observe(metrics)))
            self._wrapped[full_method] = cached
        return cached[1]

    def _observe(self, method: _MethodMetrics) -> Callable[[Behavior, bool], Behavior]:
        def around(behavior: Behavior, streaming: bool) -> Behavior:
            if streaming:
                async def stream(request, context):
                    with _CallRecord(method, context) as record:
                        try:
                            async for response in behavior(request, context):
                                yield response
                        except Exception as exc:  # noqa: BLE001 - mapped, never leaked
                            await record.fail(exc)
                return stream

            async def unary(request, context):
                with _CallRecord(method, context) as record:
                    try:
                        return await behavior(request, context)
                    except Exception as exc:  # noqa: BLE001 - mapped, never leaked
                        await record.fail(exc)
            return unary
        return around


class _MethodMetrics:
    """One method's labelled metric children, looked up once."""

    def __init__(self, owner: ObservabilityInterceptor, name: str) -> None:
        self.name = name
        self.in_flight = owner._in_flight.labels(name)
        self.duration = owner._duration.labels(name)
        self._requests = owner._requests
        self._by_code: dict[str, object] = {}

    def declare(self) -> None:
        """Create the OK counter child (at 0); the gauge and histogram children exist once looked up."""
        if "OK" not in self._by_code:
            self._by_code["OK"] = self._requests.labels(self.name, "OK")

    def count(self, code: str) -> None:
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._requests.labels(self.name, code)
        child.inc()


class _CallRecord:
    """Times one RPC, decides its final code, and records metrics and a log line on exit."""

    def __init__(self, method: _MethodMetrics, context: grpc.aio.ServicerContext) -> None:
        self.metrics, self.method, self.context = method, method.name, context
        self.code = "OK"
        self.principal: Principal | None = None  # set by the auth interceptor (None: auth off, dev)
        self.needed: str | None = None

    def __enter__(self) -> _CallRecord:
        self.start = time.perf_counter()
        self.metrics.in_flight.inc()
        self._reset = _call_record.set(self)
        return self

    async def fail(self, exc: Exception) -> None:
        if isinstance(exc, AbortError):  # the servicer or another interceptor already set the status
            self.code = _code_name(self.context.code())
            raise exc
        if isinstance(exc, OpmlError):
            self.code = exc.code
            await self.context.abort(grpc.StatusCode[exc.code], wire_message(exc),
                                     trailing_metadata=trailing_details(exc))
        if isinstance(exc, _REDIS_UNREACHABLE):  # Redis restarting or gone: the caller may retry, not a bug
            self.code = "UNAVAILABLE"
            log.warning("%s: Redis is unreachable (%s)", self.method, type(exc).__name__)
            await self.context.abort(grpc.StatusCode.UNAVAILABLE,
                                     f"Redis is unreachable ({type(exc).__name__}); retry when it is back")
        incident = uuid.uuid4().hex[:12]
        self.code = "INTERNAL"
        log.exception("unhandled error in %s (incident %s)", self.method, incident)
        await self.context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); see service logs")

    def __exit__(self, exc_type, exc, _tb) -> None:
        elapsed = time.perf_counter() - self.start
        if exc_type is not None and self.code == "OK":  # cancelled, or aborted by the servicer itself
            self.code = "CANCELLED" if issubclass(exc_type, asyncio.CancelledError) else _code_name(self.context.code())
        self.metrics.in_flight.dec()
        self.metrics.count(self.code)
        self.metrics.duration.observe(elapsed)
        try:
            _call_record.reset(self._reset)
        except ValueError:  # a stream's last step ran in another context: the call's task ends anyway
            pass
        audited = self.code != "OK" or self.needed in AUDITED_ROLES
        level = logging.INFO if audited else logging.DEBUG
        if log.isEnabledFor(level):
            principal = self.principal or current_principal()
            log.log(level, "rpc", extra={"method": self.method, "code": self.code,
                                         "duration_ms": round(elapsed * 1000, 3),
                                         "principal": principal.name, "role_needed": self.needed or "-"})


_REDIS_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""What a handler's Redis call raises while the server restarts or is gone: UNAVAILABLE, never INTERNAL."""


def _code_name(code: grpc.StatusCode | None) -> str:
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


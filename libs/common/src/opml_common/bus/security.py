"""How every Kafka client of the platform authenticates and encrypts: one function, one place.

:func:`kafka_client_kwargs` turns the ``OPML_KAFKA_*`` security settings of
:class:`~opml_common.config.PlatformSettings` into the keyword arguments aiokafka's producer,
consumer and admin client take (``bootstrap_servers``, ``security_protocol``, ``sasl_*``,
``ssl_context``). :class:`~opml_common.bus.EventPublisher`, :class:`~opml_common.bus.EventConsumer`
and :func:`~opml_common.bus.ensure_topics` build their clients with it (the tracers inside jobs
publish through ``EventPublisher``), so a client that talks to Kafka some other way does not exist.

The password is read out of its ``SecretStr`` only here, into the client's arguments; it is never
formatted into a message (:func:`describe` is what logs and errors show).
"""

from __future__ import annotations

from typing import Any

from aiokafka.helpers import create_ssl_context

from opml_common.config import PlatformSettings


def kafka_client_kwargs(settings: PlatformSettings) -> dict[str, Any]:
    """The connection and security arguments of an aiokafka client for ``settings``.

    PLAINTEXT: only ``bootstrap_servers`` and ``security_protocol``. SSL and SASL_SSL add an
    ``ssl_context`` (``create_ssl_context`` with the CA file, or the system's CAs, and the client
    certificate and key when given; hostname checking on). SASL_PLAINTEXT and SASL_SSL add
    ``sasl_mechanism`` with ``sasl_plain_username``/``sasl_plain_password`` (aiokafka reads them for
    SCRAM too). The settings were validated when they were read, so this does not raise for them;
    an unreadable or malformed PEM file raises ``ssl.SSLError``/``OSError`` from ``create_ssl_context``.
    """
    protocol = settings.kafka_security_protocol
    kwargs: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap, "security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=settings.kafka_ssl_cafile or None,
            certfile=settings.kafka_ssl_certfile or None,
            keyfile=settings.kafka_ssl_keyfile or None,
        )
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        kwargs["sasl_mechanism"] = settings.kafka_sasl_mechanism
        kwargs["sasl_plain_username"] = settings.kafka_sasl_username
        kwargs["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return kwargs


def describe(settings: PlatformSettings) -> str:
    """``<bootstrap> (<protocol>[, <mechanism> as <user>])`` for messages: never the password."""
    protocol = settings.kafka_security_protocol
    if protocol.startswith("SASL_"):
        return (f"{settings.kafka_bootstrap} ({protocol}, {settings.kafka_sasl_mechanism} "
                f"as {settings.kafka_sasl_username!r})")
    return f"{settings.kafka_bootstrap} ({protocol})"

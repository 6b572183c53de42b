"""Clients for the platform's stores, built from PlatformSettings: S3 (minio) and Redis."""

from __future__ import annotations

from urllib.parse import urlparse

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import urllib3
from minio import Minio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from opml_common.config import PlatformSettings


def s3_client(settings: PlatformSettings, *, max_connections: int = 64) -> Minio:
    """A minio client for the configured S3 endpoint, with a pool big enough for parallel transfers."""
    url = urlparse(settings.s3_endpoint)
    http = urllib3.PoolManager(
        maxsize=max_connections,
        timeout=urllib3.Timeout(connect=5, read=60),
        retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
    )
    return Minio(
        url.netloc,
        access_key=settings.s3_access_key.get_secret_value(),
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
        secure=url.scheme == "https",
        http_client=http,
    )


def redis_client(settings: PlatformSettings) -> aioredis.Redis:
    """An asyncio Redis client; every key a service writes starts with ``settings.redis_prefix``.

    A command that finds its pooled connection closed (Redis restarted since it was opened) is sent
    again on a new connection, twice at most, 50-100 ms apart: a restarted Redis costs the first
    requests after it nothing. Only ConnectionError is retried (a command that timed out may have run:
    redis-py's Retry also retries timeouts unless told otherwise, which re-ran an INCR or an RPUSH).
    """
    return aioredis.from_url(settings.redis_url, decode_responses=False,
                             retry=Retry(ExponentialBackoff(cap=0.1, base=0.05), 2,
                                         supported_errors=(redis_errors.ConnectionError,)),
                             retry_on_error=[redis_errors.ConnectionError])

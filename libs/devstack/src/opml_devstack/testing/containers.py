"""Real infrastructure from Docker images (Apache Kafka, MinIO, Redis) through testcontainers.

Used by the test fixtures only where a Docker engine answers; this project's machines have none,
so there the embedded binaries are used instead (see :mod:`opml_devstack.devinfra`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from opml_devstack.devinfra import Endpoints


def docker_available() -> bool:
    """True when a Docker engine answers a ping (a client binary alone is not enough)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and not os.path.exists(host.removeprefix("unix://")):
        return False
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no engine, no socket, no package: all mean "no Docker"
        return False


@contextmanager
def start_containers() -> Iterator[Endpoints]:
    """Start Kafka (KRaft), MinIO and Redis containers; stop them on exit."""
    from testcontainers.kafka import KafkaContainer
    from testcontainers.minio import MinioContainer
    from testcontainers.redis import RedisContainer

    with KafkaContainer().with_kraft() as kafka, MinioContainer() as minio, RedisContainer() as redis:
        minio_config = minio.get_config()
        yield Endpoints(
            kafka_bootstrap=kafka.get_bootstrap_server(),
            s3_endpoint=f"http://{minio_config['endpoint']}",
            s3_access_key=minio_config["access_key"],
            s3_secret_key=minio_config["secret_key"],
            redis_url=f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0",
        )

"""The leader lease against a real Redis: one leader at a time, hand-over on release, and fencing that
refuses a deposed leader's write even while it still believes it leads."""

import asyncio
import signal
import subprocess

import pytest
import redis.asyncio as aioredis

from opml_common.lease import LeaderLease, NotLeader
from opml_devstack.devinfra import free_port


@pytest.fixture
async def redis(platform_settings):
    client = aioredis.from_url(platform_settings.redis_url)
    yield client
    keys = [key async for key in client.scan_iter(f"{platform_settings.redis_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def _lease(redis, platform_settings, holder: str, **kwargs) -> LeaderLease:
    return LeaderLease(redis, "scheduler", holder, prefix=platform_settings.redis_prefix, **kwargs)


async def test_one_replica_leads_and_the_other_takes_over_when_it_stops(redis, platform_settings):
    first, second = _lease(redis, platform_settings, "a", ttl_s=30), _lease(redis, platform_settings, "b", ttl_s=0.6)
    async with first:
        await first.wait_leading()
        async with second:
            await asyncio.sleep(0)  # its first try is refused: the lease is held
            assert first.leading and not second.leading
            await first.stop()  # releases at once: no waiting out a 30 s TTL
            await second.wait_leading()
            assert second.token > 0 and not first.leading


async def test_a_deposed_leaders_write_is_refused_while_it_still_believes_it_leads(redis, platform_settings):
    key = f"{platform_settings.redis_prefix}lease:scheduler"
    old, new = _lease(redis, platform_settings, "old", ttl_s=30), _lease(redis, platform_settings, "new", ttl_s=30)
    async with old:
        await old.wait_leading()
        await redis.delete(key)  # as if its lease expired while it stalled
        async with new:
            await new.wait_leading()
            assert old.leading  # its own clock has not run out
            with pytest.raises(NotLeader, match="moved on"):
                async with old.fenced() as pipe:
                    pipe.set(f"{platform_settings.redis_prefix}state", "old")
            async with new.fenced() as pipe:
                pipe.set(f"{platform_settings.redis_prefix}state", "new")
    assert await redis.get(f"{platform_settings.redis_prefix}state") == b"new"


async def test_a_write_in_flight_when_the_lease_moves_is_not_applied(redis, platform_settings):
    key = f"{platform_settings.redis_prefix}lease:scheduler"
    old, new = _lease(redis, platform_settings, "old", ttl_s=30), _lease(redis, platform_settings, "new", ttl_s=30)
    async with old:
        await old.wait_leading()
        with pytest.raises(NotLeader, match="taken while old was writing"):
            async with old.fenced() as pipe:
                pipe.set(f"{platform_settings.redis_prefix}state", "old")
                await redis.delete(key)
                await new.start()
                await new.wait_leading()
        await new.stop()
    assert await redis.get(f"{platform_settings.redis_prefix}state") is None


async def test_a_lost_lease_is_noticed_and_taken_again_with_a_larger_token(redis, platform_settings):
    changes: asyncio.Queue[bool] = asyncio.Queue()
    lease = _lease(redis, platform_settings, "a", ttl_s=0.6, on_change=changes.put_nowait)
    async with lease:
        assert await changes.get() is True
        first = lease.token
        await redis.delete(f"{platform_settings.redis_prefix}lease:scheduler")
        assert await changes.get() is False  # its renewal found the key gone
        assert await changes.get() is True
        assert lease.token > first


async def test_a_leader_cut_off_from_redis_stops_leading_by_its_own_clock(tmp_path):
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=0.2&socket_connect_timeout=0.2")
    changes: asyncio.Queue[bool] = asyncio.Queue()
    lease = LeaderLease(client, "scheduler", "a", ttl_s=0.9, on_change=changes.put_nowait)
    try:
        while True:  # the server is up once it answers
            try:
                await client.ping()
                break
            except aioredis.ConnectionError:
                await asyncio.sleep(0.05)
        async with lease:
            assert await changes.get() is True
            server.kill()
            server.wait()
            assert await changes.get() is False
            assert not lease.leading
            with pytest.raises(NotLeader):
                _ = lease.token
    finally:
        server.kill()
        server.wait()
        await client.aclose()


async def test_a_leader_whose_redis_stops_answering_steps_down_when_its_tenure_ends(tmp_path):
    """A stalled Redis (SIGSTOP: connections stay open, nothing answers) and a client with no socket
    timeout: the renewal is abandoned at the tenure's end, and on_change(False) comes then."""
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    changes: asyncio.Queue[bool] = asyncio.Queue()
    lease = LeaderLease(client, "scheduler", "a", ttl_s=0.9, on_change=changes.put_nowait)
    try:
        while True:
            try:
                await client.ping()
                break
            except aioredis.ConnectionError:
                await asyncio.sleep(0.05)
        async with lease:
            assert await changes.get() is True
            server.send_signal(signal.SIGSTOP)
            assert await changes.get() is False
            assert not lease.leading
            server.send_signal(signal.SIGCONT)
            assert await changes.get() is True  # it answers again: the expired lease is taken anew
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
        await client.aclose()


async def test_the_fence_names_the_tenures_token_for_a_stores_own_script(redis, platform_settings):
    lease = _lease(redis, platform_settings, "a", ttl_s=30)
    with pytest.raises(NotLeader):
        _ = lease.fence
    async with lease:
        await lease.wait_leading()
        fence = lease.fence
        assert int(await redis.get(fence.key)) == fence.token == lease.token

"""What the control plane remembers across restarts: deployed model versions (with where each came
from), the profiles measured on deploy and the serving-configuration measurements
(:mod:`.serving_models`), in Redis.

The highest version number given per model is kept apart from the records
(``<prefix>inference-router:last-versions``), so a number is never given twice: not after a
rollback retired a version, not after an undeploy deleted the model's record, not after a restart.

A router restarted with these keys rebuilds its deployments: it fetches the bundles again where
its work directory lost them, re-plans from the stored profiles (no re-profiling) and loads the
replicas on its fresh workers. With the keys gone it starts empty (DESIGN: Redis is hot state).

Router replicas (:mod:`~opml_inference_router.leadership`) share these keys: only the holder of the
``inference-router`` lease writes them, each write checked against the lease's fence in the same
Lua script (a deposed leader's late write is refused: ``NotLeader``), and each write bumps
``<prefix>inference-router:generation``, which the followers watch to mirror what changed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from opml_common.lease import Fence, NotLeader
from opml_inference_router_contract.model_config import ModelConfig

DEPLOYING, SERVING, FAILED = "DEPLOYING", "SERVING", "FAILED"


@dataclass(frozen=True)
class Source:
    """Where a version's bundle comes from: a bundle-store bundle, or a local directory (dev)."""

    context: str = ""
    bundle: str = ""
    model_dir: str = ""

    def __str__(self) -> str:
        return f"contexts/{self.context}/bundles/{self.bundle}" if self.bundle else self.model_dir


@dataclass
class VersionRecord:
    """One deployed (or failed) version of a model."""

    version: int
    source: Source
    directory: str                      # the bundle on this machine (fetched, or the model_dir)
    state: str = DEPLOYING
    reason: str = ""
    bundle_uuid: str = ""
    created: float = field(default_factory=time.time)
    config: ModelConfig | None = field(default=None, compare=False)  # read from directory; not stored

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("config")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionRecord:
        return cls(**{**data, "source": Source(**data["source"])})


@dataclass
class ModelRecord:
    """A deployed model: its versions and which one is stable (keeps the traffic a canary leaves)."""

    name: str
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    stable: int | None = None
    traffic: dict[str, float] = field(default_factory=dict)  # version -> weight, as the router splits

    def serving(self) -> list[VersionRecord]:
        return [record for _, record in sorted(self.versions.items()) if record.state == SERVING]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stable": self.stable, "traffic": self.traffic,
                "versions": [record.to_dict() for record in self.versions.values()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRecord:
        versions = [VersionRecord.from_dict(item) for item in data["versions"]]
        return cls(data["name"], {record.version: record for record in versions}, data.get("stable"),
                   dict(data.get("traffic", {})))


# KEYS: the written key, the generation, [the fence]; ARGV: the fence's token ('' unfenced), the command, its args
_WRITE = """
if #KEYS == 3 and redis.call('GET', KEYS[3]) ~= ARGV[1] then return 0 end
redis.call(ARGV[2], KEYS[1], unpack(ARGV, 3))
redis.call('INCR', KEYS[2])
return 1
"""


class DeploymentStore:
    """Model records (one hash field per model) and the profile book (one JSON value) in Redis.

    ``fence``: the lease's fence of the replica that writes (raises ``NotLeader`` when it leads no
    more); None: one router, the only writer. :meth:`generation` changes with every write."""

    def __init__(self, redis: Any, *, prefix: str, fence: Callable[[], Fence] | None = None) -> None:
        self._redis = redis
        self._models_key = f"{prefix}inference-router:deployments"
        self._profiles_key = f"{prefix}inference-router:profiles"
        self._last_versions_key = f"{prefix}inference-router:last-versions"
        self._serving_samples_key = f"{prefix}inference-router:serving-samples"
        self._generation_key = f"{prefix}inference-router:generation"
        self._fence = fence
        self._write_script = redis.register_script(_WRITE)

    async def _write(self, command: str, key: str, *args: Any) -> None:
        """One write, made only while this replica's tenure holds the fence. Raises: NotLeader."""
        fence = self._fence() if self._fence is not None else None
        keys = [key, self._generation_key] + ([fence.key] if fence is not None else [])
        token = str(fence.token) if fence is not None else ""
        if not await self._write_script(keys=keys, args=[token, command, *args]):
            raise NotLeader(f"the inference-router lease moved on (this tenure's fence {token}): "
                            f"the deployments were not written")

    async def generation(self) -> int:
        """A number that changes with every write (0 before the first)."""
        return int(await self._redis.get(self._generation_key) or 0)

    async def save_model(self, record: ModelRecord) -> None:
        await self._write("HSET", self._models_key, record.name, json.dumps(record.to_dict()))

    async def delete_model(self, name: str) -> None:
        await self._write("HDEL", self._models_key, name)

    async def save_last_version(self, name: str, number: int) -> None:
        await self._write("HSET", self._last_versions_key, name, number)

    async def load_last_versions(self) -> dict[str, int]:
        """The highest version number given per model (empty when nothing is stored)."""
        stored = await self._redis.hgetall(self._last_versions_key)
        return {_text(name): int(number) for name, number in stored.items()}

    async def save_profiles(self, profiles: dict[str, Any]) -> None:
        await self._write("SET", self._profiles_key, json.dumps(profiles))

    async def save_serving_samples(self, key: str, samples: list[dict[str, Any]]) -> None:
        """The serving-configuration measurements of one version on one kind (:mod:`.serving_models`)."""
        await self._write("HSET", self._serving_samples_key, key, json.dumps(samples))

    async def load_serving_samples(self, key: str) -> list[dict[str, Any]]:
        """Those saved under ``key`` (empty when none are)."""
        stored = await self._redis.hget(self._serving_samples_key, key)
        return json.loads(stored) if stored else []

    async def load(self) -> tuple[list[ModelRecord], dict[str, Any]]:
        """The stored model records and profile book (empty when nothing is stored)."""
        models = await self._redis.hgetall(self._models_key)
        profiles = await self._redis.get(self._profiles_key)
        records = [ModelRecord.from_dict(json.loads(value)) for _, value in sorted(models.items())]
        return records, json.loads(profiles) if profiles else {}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

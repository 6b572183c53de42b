"""Version numbers: they only grow per model, and a number once given (served, retired, rolled back
or undeployed) is never given again. The highest given is kept in the store (Redis) across restarts,
written before the deploy acts. A deploy that fails before its version serves (a model the loader
refuses, no room) releases its number: the next deploy gets it, so a user's failed tries leave no
gaps. A version that served and later failed (not restored after a restart) keeps its number."""

from __future__ import annotations

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from opml_inference_router.control.state import FAILED, SERVING, DeploymentStore, ModelRecord
from opml_inference_router.control.validation import MAX_VERSION


class VersionNumbers:
    """The highest version number given per model. Its callers hold the deploy lock: one deploy gives,
    and on failure releases, a number before the next deploy chooses."""

    def __init__(self, store: DeploymentStore | None = None) -> None:
        self._store = store
        self._last: dict[str, int] = {}

    async def load(self) -> None:
        """Reads what the store remembers (nothing without a store)."""
        if self._store is not None:
            self._last = await self._store.load_last_versions()

    def choose(self, record: ModelRecord, requested: int) -> int:
        """The number a deploy of ``requested`` (0: the next) gets for ``record``'s model.

        Raises:
            AlreadyExists: that version serves.
            InvalidArgument: the number was given before (only a failed version may be deployed again).
            FailedPrecondition: the model has given every version number.
        """
        kept = (number for number, entry in record.versions.items() if entry.state != FAILED)
        last = max(self._last.get(record.name, 0), max(kept, default=0))  # a FAILED one's is given only if kept
        number = requested or last + 1
        if number > MAX_VERSION:
            raise FailedPrecondition(f"models/{record.name} has given every version number up to {MAX_VERSION}; "
                                     "deploy it under another name")
        existing = record.versions.get(number)
        if existing is not None and existing.state == SERVING:
            raise AlreadyExists(f"models/{record.name}/versions/{number} already serves; deploy another "
                                f"version or undeploy the model first")
        if number <= last and existing is None:
            raise InvalidArgument("version", f"must be > {last} (0: the next): models/{record.name} has "
                                             f"given versions up to {last}, and a number is never reused")
        return number

    async def give(self, name: str, number: int) -> int:
        """Remembers ``number`` as given (in the store before the deploy acts, so a restart never gives
        it again) and returns the highest given before, for :meth:`release`."""
        previous = self._last.get(name, 0)
        if number > previous:
            await self._remember(name, number)
        return previous

    async def release(self, name: str, number: int, previous: int) -> None:
        """Gives ``number`` back after its deploy failed before the version served: the highest given
        is again ``previous`` (what :meth:`give` returned), so the next deploy gets the number."""
        if self._last.get(name, 0) == number and previous < number:
            await self._remember(name, previous)

    async def _remember(self, name: str, number: int) -> None:
        self._last[name] = number
        if self._store is not None:
            await self._store.save_last_version(name, number)

"""What the coordinator knows of each client: how long its rounds take and how often it answers.

TiFL (Chai et al., HPDC '20) tiers clients by these profiles; the profile is updated from every
round the client is asked to do (a completed update, a drop-out, a rejection), never from what the
client says of itself. The one thing it says, the examples it trains on (declared when it joins),
only bounds what its updates may claim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LATENCY_SMOOTHING = 0.5
"""Weight of the newest observation in the moving average of a client's round time."""


@dataclass
class ClientProfile:
    client_id: str
    joined_at: float
    present: bool = True
    round_time_s: float | None = None
    selected: int = 0
    completed: int = 0
    dropped: int = 0
    rejected: int = 0
    accuracy: float | None = None
    last_reason: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    num_examples: int | None = None  # declared at its last join (None: never declared)

    @property
    def availability(self) -> float:
        """Share of the rounds it was asked to do that it delivered (1.0 before any)."""
        return 1.0 if self.selected == 0 else self.completed / self.selected


class ProfileBook:
    """Every client that ever joined the federation, present or not."""

    def __init__(self) -> None:
        self.clients: dict[str, ClientProfile] = {}

    def join(self, client_id: str, now: float, labels: dict[str, str] | None = None,
             num_examples: int | None = None) -> ClientProfile:
        """The client is present; ``num_examples`` (when given) replaces its declared example count."""
        profile = self.clients.get(client_id)
        if profile is None:
            profile = self.clients[client_id] = ClientProfile(client_id, joined_at=now)
        profile.present = True
        if labels:
            profile.labels = dict(labels)
        if num_examples is not None:
            profile.num_examples = int(num_examples)
        return profile

    def leave(self, client_id: str) -> None:
        if client_id in self.clients:
            self.clients[client_id].present = False

    def present(self) -> list[ClientProfile]:
        return [p for p in self.clients.values() if p.present]

    def selected(self, client_id: str) -> None:
        self.clients[client_id].selected += 1

    def completed(self, client_id: str, elapsed_s: float, accuracy: float | None) -> None:
        profile = self.clients[client_id]
        profile.completed += 1
        profile.round_time_s = elapsed_s if profile.round_time_s is None else (
            LATENCY_SMOOTHING * elapsed_s + (1 - LATENCY_SMOOTHING) * profile.round_time_s)
        if accuracy is not None:
            profile.accuracy = accuracy

    def dropped(self, client_id: str, reason: str, elapsed_s: float | None = None) -> None:
        """A client that did not deliver: counted against its availability. Its round time is
        what its completed rounds measured; a client that never completed one is taken to need
        at least the time it was given (so it is tiered as slow, not as unknown-and-fast), while
        a fast client's occasional drop-out does not make it slow."""
        profile = self.clients[client_id]
        profile.dropped += 1
        profile.last_reason = reason
        if elapsed_s is not None and profile.completed == 0:
            profile.round_time_s = max(profile.round_time_s or 0.0, elapsed_s)

    def rejected(self, client_id: str, reason: str) -> None:
        profile = self.clients[client_id]
        profile.rejected += 1
        profile.last_reason = reason

    def to_dict(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.clients.values()]

    @classmethod
    def from_dict(cls, rows: list[dict[str, Any]]) -> ProfileBook:
        book = cls()
        for row in rows:
            profile = ClientProfile(**row)
            profile.present = False  # after a restart a client is present once it joins again
            book.clients[profile.client_id] = profile
        return book

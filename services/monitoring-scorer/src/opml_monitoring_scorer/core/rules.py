"""Alert rules: a signal of each closed window against a bound, for N windows, with hysteresis.

```yaml
rules:
  - name: accuracy-low
    signal: mpp            # score | mpp | cbpe | true | drift | data_quality
    under: 0.85            # or `over` (drift and data_quality take `over`; an MAE estimate too)
    for: 3                 # windows in a row past the bound to raise (default 1)
    clear_after: 3         # windows in a row back inside, by `margin`, to resolve (default: `for`)
    margin: 0.02           # hysteresis band: resolve only at under + margin (over - margin)
  - name: drift
    signal: drift
    over: 0.15             # distance (normed Wasserstein / Jensen-Shannon) of any feature...
    features: [age]        # ...or of these (default: any). Without `over`: the drift test's own decision
```

A rule whose signal a window lacks (``true`` before labels, ``cbpe`` without a labelled reference)
neither breaches nor clears: the run counts of that rule carry over to the next window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opml_common.errors import InvalidArgument, brief

SIGNALS = ("score", "mpp", "cbpe", "true", "drift", "data_quality")
_KEYS = {"name", "signal", "under", "over", "for", "clear_after", "margin", "features"}
MAX_RULES = 100


@dataclass(frozen=True)
class Rule:
    name: str
    signal: str
    under: float | None = None
    over: float | None = None
    windows: int = 1
    clear_after: int = 1
    margin: float = 0.0
    features: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "signal": self.signal, "for": self.windows,
                               "clear_after": self.clear_after, "margin": self.margin}
        if self.under is not None:
            out["under"] = self.under
        if self.over is not None:
            out["over"] = self.over
        if self.features:
            out["features"] = list(self.features)
        return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_rules(items: Any, *, path: str = "rules") -> tuple[Rule, ...]:
    """Raises: InvalidArgument: every wrong field, as ``rules[i].field``, at once."""
    if not isinstance(items, list):
        raise InvalidArgument(path, f"must be a list of rules, but got {brief(items)}")
    if len(items) > MAX_RULES:
        raise InvalidArgument(path, f"holds {len(items)} rules, more than the {MAX_RULES} allowed")
    problems: list[tuple[str, str]] = []
    rules: list[Rule] = []
    names: set[str] = set()
    for index, item in enumerate(items):
        at = f"{path}[{index}]"
        if not isinstance(item, Mapping):
            problems.append((at, f"must be a mapping, but got {brief(item)}"))
            continue
        count = len(problems)
        for key in item:
            if key not in _KEYS:
                problems.append((f"{at}.{key}", f"is not a rule setting; they are {', '.join(sorted(_KEYS))}"))
        name = item.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            problems.append((f"{at}.name", f"must be a name of 1-64 characters, but got {brief(name)}"))
        elif name in names:
            problems.append((f"{at}.name", f"{name!r} names another rule already"))
        else:
            names.add(name)
        signal = item.get("signal")
        if signal not in SIGNALS:
            problems.append((f"{at}.signal", f"must be one of {', '.join(SIGNALS)}, but got {brief(signal)}"))
        under, over = item.get("under"), item.get("over")
        for key, value in (("under", under), ("over", over)):
            if value is not None and not _number(value):
                problems.append((f"{at}.{key}", f"must be a number, but got {brief(value)}"))
        if under is not None and over is not None:
            problems.append((at, "sets both under and over; a rule has one bound"))
        if under is None and over is None and signal != "drift":
            problems.append((at, "needs a bound: under or over"))
        if signal in ("drift", "data_quality") and under is not None:
            problems.append((f"{at}.under", f"{signal} is bad when high: use over"))
        windows, clear_after, margin = item.get("for", 1), item.get("clear_after"), item.get("margin", 0.0)
        if not isinstance(windows, int) or isinstance(windows, bool) or not 1 <= windows <= 1000:
            problems.append((f"{at}.for", f"must be an integer in [1, 1000], but got {brief(windows)}"))
            windows = 1
        if clear_after is None:
            clear_after = windows
        elif not isinstance(clear_after, int) or isinstance(clear_after, bool) or not 1 <= clear_after <= 1000:
            problems.append((f"{at}.clear_after", f"must be an integer in [1, 1000], but got {brief(clear_after)}"))
        if not _number(margin) or margin < 0:
            problems.append((f"{at}.margin", f"must be a number >= 0, but got {brief(margin)}"))
        features = item.get("features", [])
        if not isinstance(features, list) or not all(isinstance(f, str) and f for f in features):
            problems.append((f"{at}.features", f"must be a list of feature names, but got {brief(features)}"))
        elif features and signal != "drift":
            problems.append((f"{at}.features", "applies to the drift signal only"))
        if len(problems) == count:
            rules.append(Rule(name=name, signal=signal, under=None if under is None else float(under),
                              over=None if over is None else float(over), windows=windows,
                              clear_after=clear_after, margin=float(margin), features=tuple(features)))
    if problems:
        raise InvalidArgument.of(problems)
    return tuple(rules)


@dataclass(frozen=True)
class Observation:
    """What a rule saw in one window: its value, whether it breached, whether it is clear (inside by
    the margin), and the evidence (the features that drifted, their distances)."""

    value: float | None
    breached: bool
    clear: bool
    evidence: dict[str, float] = field(default_factory=dict)


def observe(rule: Rule, signals: Mapping[str, float | None], drift: Mapping[str, tuple[float, bool]]) -> Observation:
    """``signals``: the window's score/mpp/cbpe/true/data_quality values (None when absent);
    ``drift``: per feature (distance, the test's own drifted decision)."""
    if rule.signal == "drift":
        chosen = {f: d for f, d in drift.items() if not rule.features or f in rule.features}
        if not chosen:
            return Observation(None, False, False)
        if rule.over is None:
            hit = {f: d for f, (d, drifted) in chosen.items() if drifted}
            return Observation(float(len(hit)), bool(hit), not hit, hit)
        worst = max(d for d, _ in chosen.values())
        hit = {f: d for f, (d, _) in chosen.items() if d > rule.over}
        return Observation(worst, bool(hit), worst <= rule.over - rule.margin, hit)
    value = signals.get(rule.signal)
    if value is None:
        return Observation(None, False, False)
    if rule.under is not None:
        return Observation(value, value < rule.under, value >= rule.under + rule.margin)
    assert rule.over is not None
    return Observation(value, value > rule.over, value <= rule.over - rule.margin)


@dataclass
class RuleState:
    """A rule's run counts for one model version; ``firing`` with the window that raised it."""

    firing: bool = False
    breach_run: int = 0
    clear_run: int = 0
    raised_at_window: int | None = None


@dataclass(frozen=True)
class Transition:
    """An alert raised or resolved at a window."""

    rule: Rule
    raised: bool
    window: int
    observation: Observation
    raised_at_window: int | None


def step(rule: Rule, state: RuleState, observation: Observation, window: int) -> Transition | None:
    """Advances ``state`` by one window's observation; returns the alert's change, if any."""
    if observation.value is None:
        return None
    if observation.breached:
        state.breach_run += 1
        state.clear_run = 0
    elif observation.clear:
        state.clear_run += 1
        state.breach_run = 0
    else:  # inside the hysteresis band: both runs start again
        state.breach_run = state.clear_run = 0
    if not state.firing and state.breach_run >= rule.windows:
        state.firing, state.raised_at_window, state.clear_run = True, window, 0
        return Transition(rule, True, window, observation, window)
    if state.firing and state.clear_run >= rule.clear_after:
        raised_at = state.raised_at_window
        state.firing, state.raised_at_window, state.breach_run = False, None, 0
        return Transition(rule, False, window, observation, raised_at)
    return None

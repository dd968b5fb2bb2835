"""Routing policies: which model of the pair ("small" or "large") serves each turn.

A turn is *swapped* when its model differs from the one that served the previous turn of its
session (the session's previous request in the list); a session's first turn never is.

Policies (``parse_policy`` reads these names):

- ``sticky``: every turn on the small model (never swaps);
- ``alternate``: small, large, small, ... by turn number;
- ``swap-P`` (0 <= P <= 1): a session starts on the small model and each later turn switches
  from the previous turn's model with probability P, drawn from a generator seeded by
  (seed, session), so a session's models depend on nothing else;
- ``escalate-K`` (K >= 1): small before turn K, large from turn K on;
- ``router-N`` (N >= 0): large when the turn's new tokens exceed N, else small;
- ``router-WORD[,WORD...]``: large when the last user message contains one of the words
  (case-insensitive); needs a trace with text (the agentic shape).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.errors import KVMapError
from .workload import Turn

MODELS = ("small", "large")
# the router's threshold at the benchmark's default scale (1/8): 1,024 new tokens at full scale,
# which sends every first turn and the longest follow-ups of the default slice to the large model
DEFAULT_ROUTER_TOKENS = 128
POLICY_FORMS = (
    "sticky, alternate, swap-P (0 <= P <= 1), escalate-K (K >= 1), router-N (N >= 0 new tokens) "
    "or router-WORD[,WORD...]"
)

Router = Callable[[Sequence[Turn], int], list[str]]


@dataclass(frozen=True)
class Policy:
    """A routing policy by name (see the module docstring); validated on construction."""

    name: str

    def __post_init__(self):
        router_for(self.name)

    def route(self, turns: list[Turn], seed: int = 0) -> list[str]:
        """One model of MODELS per turn, in the order of ``turns``."""
        return router_for(self.name)(turns, seed)


def parse_policy(text: str) -> Policy:
    """The policy named ``text``; KVMapError naming the valid forms when it is none."""
    return Policy(text.strip())


def swapped(turns: list[Turn], models: list[str]) -> list[bool]:
    """Per turn: served by another model than its session's previous turn."""
    if len(turns) != len(models):
        raise KVMapError(f"{len(models)} models for {len(turns)} turns")
    previous: dict[int, str] = {}
    out = []
    for turn, model in zip(turns, models):
        out.append(turn.session in previous and previous[turn.session] != model)
        previous[turn.session] = model
    return out


def router_for(name: str) -> Router:
    """The routing function of the policy ``name``."""
    kind, _, argument = name.partition("-")
    if name in ("sticky", "alternate"):
        return sticky if name == "sticky" else alternate
    if kind == "swap":
        probability = _number(name, argument, float, 0.0, 1.0)
        return lambda turns, seed: random_swaps(turns, probability, seed)
    if kind == "escalate":
        at_turn = _number(name, argument, int, 1, None)
        return lambda turns, seed: escalate(turns, at_turn)
    if kind == "router" and argument.isdigit():
        threshold = int(argument)
        return lambda turns, seed: by_new_tokens(turns, threshold)
    if kind == "router" and _keywords(argument):
        keywords = _keywords(argument)
        return lambda turns, seed: by_keywords(turns, keywords, name)
    raise KVMapError(f"unknown routing policy {name!r}; valid forms: {POLICY_FORMS}")


def _number(name: str, argument: str, kind: type, low, high):
    try:
        value = kind(argument)
    except ValueError:
        value = None
    if value is None or not low <= value or (high is not None and not value <= high):
        raise KVMapError(f"bad routing policy {name!r}; valid forms: {POLICY_FORMS}")
    return value


def _keywords(argument: str) -> tuple[str, ...]:
    return tuple(word.strip().lower() for word in argument.split(",") if word.strip())


def sticky(turns: Sequence[Turn], seed: int = 0) -> list[str]:
    return ["small"] * len(turns)


def alternate(turns: Sequence[Turn], seed: int = 0) -> list[str]:
    return [MODELS[turn.turn % 2] for turn in turns]


def escalate(turns: Sequence[Turn], at_turn: int) -> list[str]:
    return [MODELS[turn.turn >= at_turn] for turn in turns]


def by_new_tokens(turns: Sequence[Turn], threshold: int) -> list[str]:
    return [MODELS[turn.new_tokens > threshold] for turn in turns]


def by_keywords(turns: Sequence[Turn], keywords: Sequence[str], name: str) -> list[str]:
    if any(turn.text is None for turn in turns):
        raise KVMapError(
            f"policy {name!r} routes by the last user message's text, but this trace has no "
            "text (the Mooncake trace has none); use router-N or a trace of the agentic shape"
        )
    return [MODELS[any(word in turn.text.lower() for word in keywords)] for turn in turns]


def random_swaps(turns: Sequence[Turn], probability: float, seed: int) -> list[str]:
    """Each session starts small; each later turn switches with ``probability``, drawn from a
    generator of its own seeded by (seed, session)."""
    generators: dict[int, random.Random] = {}
    current: dict[int, str] = {}
    models = []
    for turn in turns:
        if turn.session not in current:
            generators[turn.session] = random.Random(f"{seed}/{turn.session}")
            current[turn.session] = "small"
        elif generators[turn.session].random() < probability:
            current[turn.session] = other_model(current[turn.session])
        models.append(current[turn.session])
    return models


def other_model(model: str) -> str:
    return MODELS[1 - MODELS.index(model)]

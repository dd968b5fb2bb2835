"""Routing policies: which model serves each turn, and which turns are swapped."""

import pytest

from sgl_kvmap.bench.routing import MODELS, Policy, parse_policy, swapped
from sgl_kvmap.bench.workload import Turn
from sgl_kvmap.core.errors import KVMapError

# one of each form the benchmark offers, with the swap probabilities users ask for
EVERY_FORM = (
    "sticky",
    "alternate",
    "swap-0.1",
    "swap-0.25",
    "swap-0.5",
    "escalate-2",
    "router-32",
)


def sessions_of(turn_counts, new_tokens=10, texts=None):
    """Turns of sessions with ``turn_counts`` turns, interleaved round by round."""
    rounds = sorted((t, s) for s, count in enumerate(turn_counts) for t in range(count))
    return [
        Turn(
            request,
            session,
            turn,
            float(request),
            (1,) * 8,
            new_tokens,
            4,
            None if texts is None else texts[request % len(texts)],
        )
        for request, (turn, session) in enumerate(rounds)
    ]


def swaps_of(policy, turns, seed=0):
    return swapped(turns, parse_policy(policy).route(turns, seed))


def test_every_form_parses_and_routes_to_the_two_models():
    turns = sessions_of([1, 3, 5])
    for name in EVERY_FORM:
        models = parse_policy(name).route(turns)
        assert len(models) == len(turns) and set(models) <= set(MODELS)
    assert parse_policy(" sticky ") == Policy("sticky")


def test_sticky_never_swaps():
    turns = sessions_of([1, 4, 7])
    assert set(parse_policy("sticky").route(turns)) == {"small"}
    assert not any(swaps_of("sticky", turns))


def test_alternate_swaps_every_turn_after_the_first():
    turns = sessions_of([1, 4, 7])
    assert swaps_of("alternate", turns) == [t.turn > 0 for t in turns]
    assert parse_policy("alternate").route(turns) == [MODELS[t.turn % 2] for t in turns]


def test_swapped_compares_with_the_sessions_previous_turn_only():
    turns = sessions_of([2, 2])  # requests: (s0 t0) (s1 t0) (s0 t1) (s1 t1)
    assert swapped(turns, ["small", "large", "small", "small"]) == [False, False, False, True]
    with pytest.raises(KVMapError, match="3 models for 4 turns"):
        swapped(turns, ["small"] * 3)


@pytest.mark.parametrize("probability", [0.1, 0.25, 0.5])
def test_swap_p_swaps_later_turns_with_frequency_p(probability):
    turns = sessions_of([6] * 2000)
    swaps = swaps_of(f"swap-{probability}", turns)
    later = [s for s, t in zip(swaps, turns) if t.turn > 0]
    assert not any(s for s, t in zip(swaps, turns) if t.turn == 0)
    assert abs(sum(later) / len(later) - probability) < 0.02  # 10,000 draws: 4+ sigma


def test_swap_p_is_deterministic_per_seed_and_session():
    turns = sessions_of([5] * 40)
    policy = parse_policy("swap-0.5")
    assert policy.route(turns, seed=3) == policy.route(turns, seed=3)
    assert policy.route(turns, seed=3) != policy.route(turns, seed=4)
    alone = [t for t in turns if t.session == 7]  # a session's models depend on nothing else
    together = [m for m, t in zip(policy.route(turns, seed=3), turns) if t.session == 7]
    assert policy.route(alone, seed=3) == together
    assert not any(swaps_of("swap-0", turns)) and sum(swaps_of("swap-1", turns)) == 40 * 4


@pytest.mark.parametrize("at_turn", [1, 2, 3])
def test_escalate_swaps_exactly_once_in_each_session_that_reaches_turn_k(at_turn):
    turns = sessions_of([1, 2, 3, 4, 5])
    swaps = swaps_of(f"escalate-{at_turn}", turns)
    for session, count in enumerate([1, 2, 3, 4, 5]):
        mine = [s for s, t in zip(swaps, turns) if t.session == session]
        assert sum(mine) == (count > at_turn)
    models = parse_policy(f"escalate-{at_turn}").route(turns)
    assert models == ["large" if t.turn >= at_turn else "small" for t in turns]


def test_router_sends_turns_with_more_new_tokens_than_n_to_the_large_model():
    turns = [t for n in (0, 63, 64, 65, 500) for t in sessions_of([1], new_tokens=n)]
    assert parse_policy("router-64").route(turns) == ["small", "small", "small", "large", "large"]
    assert parse_policy("router-0").route(turns) == ["small"] + ["large"] * 4


def test_keyword_router_reads_the_last_user_message():
    texts = ["Please PROVE it", "thanks", "a follow-up question", None]
    turns = sessions_of([3], texts=texts[:3])
    assert parse_policy("router-prove,follow-up").route(turns) == ["large", "small", "large"]
    with pytest.raises(KVMapError, match="no text"):
        parse_policy("router-prove").route(sessions_of([2]))


@pytest.mark.parametrize(
    "name",
    [
        "",
        "random",
        "swap",
        "swap-",
        "swap-1.5",
        "swap--0.1",
        "swap-nan",
        "swap-x",
        "escalate-0",
        "escalate-1.5",
        "router-",
        "router-,",
        "sticky-2",
    ],
)
def test_bad_policy_names_are_refused_naming_the_valid_forms(name):
    with pytest.raises(KVMapError, match="valid forms: sticky, alternate, swap-P"):
        parse_policy(name)

"""The hand-off: one target forward does the sink tokens, the tail and the last prompt token,
and the repair's anchors picked by a source draft."""

import dataclasses

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.token_weights import attention_paid
from sgl_kvmap.models.capture import (
    capture_kv,
    run,
)
from sgl_kvmap.models.transfer import (
    ANCHOR_CHOICES,
    Repair,
    draft_anchors,
    draft_attention,
    handoff,
    handoff_split,
    lookup_guess,
    pick_anchors,
    source_prompt_anchors,
    target_tail_anchors,
    top_attended,
    translate_prefix,
)

from .conftest import assert_same_cache


@pytest.mark.parametrize("tail", [0, 5])
def test_one_forward_handoff_equals_sinks_then_the_rest(tiny_pair, tiny_mapper, tail):
    """Sinks fused into the hand-off forward: the same cache and logits as computing the
    sinks first (translate_prefix) and then the rest of the prompt over that cache."""
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=3)
    ids = torch.randint(0, 100, (40,))
    split = handoff_split(len(ids), tail)
    source_cache = capture_kv(source.model, ids[:split])
    got = handoff(mapper, source_cache, ids, target.model, tail)
    translated = translate_prefix(mapper, source_cache, ids[:split], target.model)
    want = run(target.model, ids[split:], past=translated, logits_to_keep=1)
    assert_same_cache(got.cache, want.cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    mapped = mapper.map(source_cache)  # the sinks really were recomputed
    assert not torch.allclose(got.cache.keys[1][:3], mapped.keys[1][:3])
    torch.testing.assert_close(got.cache.keys[1][3:split], mapped.keys[1][3:])


def test_translated_prefix_takes_the_targets_own_first_layer(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    ids = torch.randint(0, 100, (30,))
    source_cache, exact = capture_kv(source.model, ids), capture_kv(target.model, ids)
    mapped = tiny_mapper.map(source_cache)
    got = translate_prefix(tiny_mapper, source_cache, ids, target.model)
    torch.testing.assert_close(got.keys[0], exact.keys[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.values[0], exact.values[0], rtol=1e-5, atol=1e-6)
    for g, m in zip(got.keys[1:] + got.values[1:], mapped.keys[1:] + mapped.values[1:]):
        assert torch.equal(g, m)  # deeper layers: the map, untouched
    plain = translate_prefix(tiny_mapper, source_cache, ids, target.model, exact_first_layer=False)
    assert torch.equal(plain.keys[0], mapped.keys[0])


def greedy_continuation(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``ids`` followed by ``steps`` greedily decoded tokens, decoding from scratch each step."""
    for _ in range(steps):
        logits = run(model, ids, logits_to_keep=1).logits
        ids = torch.cat((ids, logits[-1].argmax()[None]))
    return ids


def test_draft_attention_is_the_attention_of_the_drafted_tokens(tiny_pair):
    """Reference: decode greedily from scratch, then read the queries of the last prompt token
    and the drafted tokens in one plain forward over prompt + draft."""
    source = tiny_pair[0].model
    ids = torch.randint(0, 100, (30,))
    for cached in (29, 20):  # the source cache may stop short of the prompt's last token
        got = draft_attention(source, capture_kv(source, ids[:cached]), ids, draft=5)
        drafted = greedy_continuation(source, ids, 4)
        whole = run(source, drafted, want_queries=True)
        want = attention_paid([q[-5:] for q in whole.queries], whole.cache.keys)[:29]
        assert got.shape == (29,)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_parallel_draft_with_enough_sweeps_is_the_greedy_draft(tiny_pair):
    """Jacobi iterations fix one more drafted token per sweep: with draft - 1 sweeps the queries
    are the greedy draft's, whatever the lookup guessed."""
    source = tiny_pair[0].model
    ids = torch.randint(0, 100, (30,))
    cache = capture_kv(source, ids[:29])
    serial = draft_attention(source, cache, ids, draft=5)
    for sweeps in (4, 6):
        torch.testing.assert_close(
            draft_attention(source, cache, ids, draft=5, sweeps=sweeps),
            serial,
            rtol=1e-4,
            atol=1e-6,
        )


def test_parallel_draft_reads_its_last_forward(tiny_pair):
    """One sweep: the queries of one parallel forward over [greedy first token, lookup guess]."""
    source = tiny_pair[0].model
    ids = torch.randint(0, 100, (30,))
    got = draft_attention(source, capture_kv(source, ids[:29]), ids, draft=6, sweeps=1)
    first = run(source, ids, logits_to_keep=1).logits[-1].argmax()[None]
    block = torch.cat((ids, first, lookup_guess(torch.cat((ids, first)), 4)))
    whole = run(source, block, want_queries=True)
    want = attention_paid([q[-6:] for q in whole.queries], whole.cache.keys)[:29]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got, draft_attention(source, capture_kv(source, ids[:29]), ids, 6))


def test_lookup_guess_copies_what_followed_the_latest_match():
    context = torch.tensor([5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3])
    assert lookup_guess(context, 3).tolist() == [7, 6, 1]  # latest earlier "1 2 3" is at 6
    # a match near the end reads on into its own copy: "4 5" follows "... 4 5" periodically
    assert lookup_guess(torch.tensor([4, 5, 4, 5]), 5).tolist() == [4, 5, 4, 5, 4]
    # the longest suffix that occurs wins: "2 3" occurs, "9 2 3" does not
    assert lookup_guess(torch.tensor([2, 3, 8, 1, 9, 2, 3]), 2).tolist() == [8, 1]
    assert lookup_guess(torch.tensor([1, 2, 3]), 2).tolist() == [3, 3]  # no match
    assert lookup_guess(torch.tensor([7]), 0).numel() == 0
    with pytest.raises(ValueError):
        lookup_guess(torch.tensor([], dtype=torch.long), 2)


def test_top_attended_takes_the_largest_after_start():
    attention = torch.tensor([9.0, 1.0, 5.0, 0.5, 7.0, 2.0])
    assert top_attended(attention, 2, start=1).tolist() == [2, 4]
    assert top_attended(attention, 3).tolist() == [0, 2, 4]
    assert top_attended(attention, 99, start=4).tolist() == [4, 5]  # capped at what is left


def test_draft_anchors_are_the_most_attended_translated_tokens(tiny_pair, tiny_mapper):
    source = tiny_pair[0].model
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=3)
    ids = torch.randint(0, 100, (40,))
    tail, repair = 6, Repair(anchors=5, draft=4)
    split = handoff_split(40, tail)
    cache = capture_kv(source, ids[:split])
    anchors = draft_anchors(source, cache, ids, repair, tail, mapper)
    paid = draft_attention(source, cache, ids, repair.draft)[:split]
    assert anchors.numel() == 5 and anchors.min() >= 3 and anchors.max() < split
    assert torch.equal(anchors, anchors.sort().values)
    rest = torch.ones(split, dtype=torch.bool)
    rest[:3] = rest[anchors] = False
    assert paid[anchors].min() >= paid[rest].max()


@pytest.mark.parametrize("tail", [0, 5])
def test_repaired_handoff_equals_repaired_prefix_then_the_rest(tiny_pair, tiny_mapper, tail):
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=2)
    ids = torch.randint(0, 100, (40,))
    split, repair = handoff_split(40, tail), Repair(anchors=6, draft=3)
    source_cache = capture_kv(source.model, ids[:split])
    got = handoff(mapper, source_cache, ids, target.model, tail, repair, source.model)
    anchors = draft_anchors(source.model, source_cache, ids, repair, tail, mapper)
    repaired = translate_prefix(mapper, source_cache, ids[:split], target.model, anchors)
    want = run(target.model, ids[split:], past=repaired, logits_to_keep=1)
    assert_same_cache(got.cache, want.cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    plain = handoff(mapper, source_cache, ids, target.model, tail)
    assert not torch.allclose(got.cache.keys[1][anchors], plain.cache.keys[1][anchors])
    others = torch.ones(split, dtype=torch.bool)
    others[:2] = others[anchors] = False
    torch.testing.assert_close(
        got.cache.keys[1][:split][others], plain.cache.keys[1][:split][others]
    )
    with pytest.raises(KVMapError, match="needs the source model"):
        handoff(mapper, source_cache, ids, target.model, tail, repair)


def test_repair_settings_are_checked():
    with pytest.raises(KVMapError):
        Repair(anchors=-1)
    with pytest.raises(KVMapError):
        Repair(anchors=4, draft=0)
    with pytest.raises(KVMapError):
        Repair(anchors=4, sweeps=-1)
    assert Repair.parse("240:32:2") == Repair(240, 32, 2)
    assert Repair.parse("112:8") == Repair(112, 8)
    for bad in ("112", "1:2:3:4", "a:8", "-1:8"):
        with pytest.raises(KVMapError):
            Repair.parse(bad)
    parallel = "8 anchors by a 32-token source draft (2 parallel sweeps)"
    assert str(Repair(8, 32, sweeps=2)) == parallel
    assert str(Repair(8, 2)) == "8 anchors by a 2-token source draft"


class ExplodingModel:
    """A model that must not run: any call or attribute read fails the test."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("the source model was called")

    def __getattr__(self, name):
        raise AssertionError(f"the source model was read ({name})")


@pytest.mark.parametrize("choice", ANCHOR_CHOICES)
def test_each_choice_picks_distinct_translated_tokens(tiny_pair, tiny_mapper, choice):
    """Never a sink, a tail token or the last token; as many as asked, ascending, distinct."""
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=3)
    ids = torch.randint(0, 100, (40,))
    tail, repair = 6, Repair(anchors=7, choice=choice)
    split = handoff_split(40, tail)
    cache = capture_kv(source.model, ids[:split])
    anchors = pick_anchors(repair, mapper, cache, ids, tail, source.model, target.model)
    assert anchors.numel() == 7 and anchors.min() >= 3 and anchors.max() < split
    assert torch.equal(anchors, anchors.unique())  # unique() sorts
    every = pick_anchors(
        Repair(99, choice=choice), mapper, cache, ids, tail, source.model, target.model
    )
    assert torch.equal(every, torch.arange(3, split))  # capped at the translated, non-sink ones


def test_source_prompt_anchors_are_what_the_sources_prompt_pass_attends(tiny_pair):
    """Reference: the source's own forward over the whole prompt, its last tail + 1 queries."""
    source = tiny_pair[0].model
    ids = torch.randint(0, 100, (40,))
    tail = 6
    split = handoff_split(40, tail)
    whole = run(source, ids, want_queries=True)
    paid = attention_paid([q[-(tail + 1) :] for q in whole.queries], whole.cache.keys)
    want = top_attended(paid[:split], 5, 2)
    for cached in (split, 40):  # the source's cache may hold the whole prompt
        got = source_prompt_anchors(source, capture_kv(source, ids[:cached]), ids, 5, tail, 2)
        assert torch.equal(got, want)


def test_target_tail_anchors_over_an_exact_cache_are_the_targets_own_pick(tiny_pair):
    """Over the target's own cache of the translated tokens, the target's tail pass attends as
    its full forward over the prompt does: the same anchors."""
    target = tiny_pair[1].model
    ids = torch.randint(0, 100, (40,))
    tail = 6
    split = handoff_split(40, tail)
    whole = run(target, ids, want_queries=True)
    paid = attention_paid([q[-(tail + 1) :] for q in whole.queries], whole.cache.keys)
    got = target_tail_anchors(target, capture_kv(target, ids[:split]), ids, 5, 2)
    assert torch.equal(got, top_attended(paid[:split], 5, 2))


def test_target_tail_handoff_runs_the_target_only(tiny_pair, tiny_mapper):
    """The source model is never called: a source whose every use fails changes nothing."""
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=2)
    ids = torch.randint(0, 100, (40,))
    tail, repair = 5, Repair(anchors=6, choice="target_tail")
    split = handoff_split(40, tail)
    cache = capture_kv(source.model, ids[:split])
    got = handoff(mapper, cache, ids, target.model, tail, repair, ExplodingModel())
    anchors = pick_anchors(repair, mapper, cache, ids, tail, target_model=target.model)
    repaired = translate_prefix(mapper, cache, ids[:split], target.model, anchors)
    want = run(target.model, ids[split:], past=repaired, logits_to_keep=1)
    assert_same_cache(got.cache, want.cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    plain = handoff(mapper, cache, ids, target.model, tail)
    assert not torch.allclose(got.cache.keys[1][anchors], plain.cache.keys[1][anchors])


def test_recent_anchors_are_a_longer_tail(tiny_pair, tiny_mapper):
    """A anchors just before a t-token tail: the same cache and logits as a (t + A)-token tail,
    to float32 rounding (the anchors sit inside the mapped cache in one forward and after it in
    the other, so the attention sums run in another order; a wrong anchor set or mask differs
    by orders of magnitude more: the last check)."""
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=2)
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0))
    cache = capture_kv(source.model, ids)
    recent = Repair(anchors=8, choice="recent")
    got = handoff(mapper, cache, ids, target.model, 5, recent, ExplodingModel())
    want = handoff(mapper, cache, ids, target.model, 13)
    shorter = handoff(mapper, cache, ids, target.model, 5)
    for g, w in zip(got.cache.keys + got.cache.values, want.cache.keys + want.cache.values):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert (shorter.logits - want.logits).abs().max() > 1e-3


def test_choices_refuse_a_missing_model(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    ids = torch.randint(0, 100, (30,))
    cache = capture_kv(source.model, ids)
    for choice in ("draft", "source_prompt"):
        with pytest.raises(KVMapError, match="needs the source model"):
            pick_anchors(Repair(4, choice=choice), tiny_mapper, cache, ids, 3, None, target.model)
    with pytest.raises(KVMapError, match="needs the target model"):
        pick_anchors(Repair(4, choice="target_tail"), tiny_mapper, cache, ids, 3, source.model)
    with pytest.raises(KVMapError, match="anchor choice must be one of"):
        Repair(4, choice="oracle")
    assert str(Repair(8, choice="recent")) == "8 anchors by recency (a longer tail)"

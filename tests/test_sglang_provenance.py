"""The ledger of delivered translations (sgl_kvmap/sglang/provenance.py): what a write may store."""

from __future__ import annotations

import pytest

from sgl_kvmap.sglang.provenance import Provenance, Verdict


def test_a_write_with_no_translation_in_its_chain_stores_everything():
    ledger = Provenance(8)
    ledger.delivered("t0", 11)
    assert ledger.verdict(["n0", "n1"], ["n2", "n3"], [1, 2]) == Verdict(2, 0)


def test_a_translated_page_written_back_is_withheld_with_everything_after_it():
    """The bytes SGLang writes for a ledger key are the bytes delivered: a translation."""
    ledger = Provenance(8)
    ledger.delivered("t1", 11)
    assert ledger.verdict(["n0"], ["n1", "t1", "n2"], [1, 11, 2]) == Verdict(1, 0, (2,))
    assert len(ledger) == 1


def test_a_write_descending_from_a_translation_stores_nothing_and_names_it_derived():
    ledger = Provenance(8)
    ledger.delivered("t0", 11)
    assert ledger.verdict(["t0", "n1"], ["n2", "n3"], [1, 2]) == Verdict(0, 0, (0, 1))


def test_a_discarded_translation_recomputed_by_the_engine_leaves_the_ledger():
    """SGLang threw the translation of t0 away and computed t0 itself (other bytes): t0 and what
    follows it are the engine's own, stored, and t0 counts as recomputed."""
    ledger = Provenance(8)
    ledger.delivered("t0", 11)
    ledger.delivered("t1", 12)
    assert ledger.verdict([], ["t0", "t1", "n2"], [99, 98, 3]) == Verdict(3, 2)
    assert len(ledger) == 0
    assert ledger.verdict(["t0", "t1"], ["n3"], [4]) == Verdict(1, 0)


def test_pages_after_a_kept_translation_are_withheld_even_if_recomputed():
    """t0 kept (no write of it), t1 discarded and recomputed on top of t0: t1 leaves the ledger
    but is withheld, since its prefix holds a translation: computed here over translated KV
    (derived), as is everything after it."""
    ledger = Provenance(8)
    ledger.delivered("t0", 11)
    ledger.delivered("t1", 12)
    assert ledger.verdict(["t0"], ["t1", "n2"], [98, 3]) == Verdict(0, 1, (0, 1))
    assert ledger.verdict(["t0", "t1"], ["n3"], [4]) == Verdict(0, 0, (0,))


def test_translations_written_back_between_derived_pages_are_not_derived():
    """A write holding an earlier translation, pages computed over it, then a later one: only
    the pages this engine computed are derived."""
    ledger = Provenance(8)
    ledger.delivered("t0", 11)
    ledger.delivered("t2", 13)
    assert ledger.verdict(["n0"], ["t0", "d1", "t2", "d3"], [11, 5, 13, 6]) == Verdict(0, 0, (1, 3))


def test_the_ledger_is_bounded_and_keeps_the_keys_it_sees_in_use():
    ledger = Provenance(3)
    for i in range(3):
        ledger.delivered(f"t{i}", i)
    ledger.seen(["t0"])  # a prefetch named t0: it is in use, t1 is now the oldest
    ledger.delivered("t3", 3)
    assert len(ledger) == 3
    assert ledger.verdict(["t0"], ["x"], [0]) == Verdict(0, 0, (0,))
    assert ledger.verdict(["t1"], ["x"], [0]) == Verdict(1, 0)


def test_a_ledger_needs_room():
    with pytest.raises(ValueError, match="capacity"):
        Provenance(0)

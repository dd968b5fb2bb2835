"""measure_speed times the same work the hand-off does, and its ratios follow from its parts."""

import dataclasses

import pytest
import torch

from sgl_kvmap.models.timing import measure_speed
from sgl_kvmap.models.transfer import (
    Repair,
)


@pytest.mark.parametrize("sinks", [0, 3])
def test_speed_report_parts_and_ratios(tiny_pair, tiny_mapper, sinks):
    source, target = tiny_pair
    mapper = dataclasses.replace(tiny_mapper, sink_tokens=sinks)
    speed = measure_speed(mapper, source, target, torch.randint(0, 100, (48,)), repeats=1, tail=4)
    assert (speed.tokens, speed.tail, speed.repeats) == (48, 4, 1)
    assert min(speed.map_seconds, speed.handoff_seconds, speed.prefill_seconds) > 0
    assert speed.total_seconds == pytest.approx(speed.map_seconds + speed.handoff_seconds)
    assert speed.end_to_end_speedup == pytest.approx(speed.prefill_seconds / speed.total_seconds)
    assert speed.speedup == pytest.approx(
        speed.prefill_seconds / (speed.map_seconds + speed.sink_seconds)
    )
    assert 0 <= speed.sink_seconds <= speed.handoff_seconds
    if sinks == 0:
        assert speed.sink_seconds == speed.separate_sink_seconds == 0
    else:
        assert speed.separate_sink_seconds > 0


def test_a_measured_prefill_is_reused(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    ids = torch.randint(0, 100, (32,))
    speed = measure_speed(tiny_mapper, source, target, ids, repeats=1, prefill_seconds=123.0)
    assert speed.prefill_seconds == 123.0


def test_speed_with_repair_counts_the_draft(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    ids = torch.randint(0, 100, (48,))
    speed = measure_speed(tiny_mapper, source, target, ids, repeats=1, repair=Repair(7, 3))
    assert speed.anchors == 7 and speed.draft_seconds > 0
    assert speed.total_seconds == pytest.approx(
        speed.map_seconds + speed.draft_seconds + speed.handoff_seconds
    )

"""The prefetch deadline ``sglang-args`` sets for engines that translate."""

import pytest

from sgl_kvmap.sglang.launch import PrefetchDeadline, prefetch_deadline


@pytest.mark.parametrize(
    "measured",
    [
        [(512, 0.30), (2048, 1.10)],  # a slow CPU at one thread
        [(512, 0.004), (2048, 0.006)],  # a GPU
        [(512, 2.0), (2048, 7.5)],  # an AVX2-only CPU in bfloat16
    ],
)
def test_the_deadline_leaves_the_margin_at_every_length(measured):
    """SGLang cuts a prefetch at base + per_ki_token x tokens / 1024 seconds: the deadline is at
    least three times the (linear) hand-over time at 2,048 and 8,192 tokens, never below
    SGLang's own defaults (1 s + 0.25 s per 1K tokens)."""
    deadline = prefetch_deadline(measured)
    (n1, t1), (n2, t2) = measured
    per_token = (t2 - t1) / (n2 - n1)
    for tokens in (2048, 8192):
        assert deadline.seconds(tokens) >= 3 * (t1 + per_token * (tokens - n1)) - 1e-6
        assert deadline.seconds(tokens) >= PrefetchDeadline().seconds(tokens)
    assert deadline.sglang_keys() == {
        "prefetch_timeout_base": deadline.base,
        "prefetch_timeout_per_ki_token": deadline.per_ki_token,
    }

"""The benchmark's workload: sessions derived from a trace, prompts of held-out text, the oracle."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvmap.bench.workload import (
    DEFAULT_TRACE,
    Turn,
    WorkloadConfig,
    derive_sessions,
    ideal_reuse,
    load_workload,
    shared_opening,
    summarize,
)
from sgl_kvmap.core.errors import KVMapError


def code_points(text, add_special_tokens=False):
    """A stand-in tokenizer: one token per character."""
    return {"input_ids": [ord(c) for c in text]}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Two files of distinct characters (no token repeats within 3,000 tokens)."""
    root = tmp_path_factory.mktemp("held_out")
    paths = [root / "a.txt", root / "b.txt"]
    paths[0].write_text("".join(map(chr, range(1000, 2500))))
    paths[1].write_text("".join(map(chr, range(2500, 4000))))
    return paths


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def request(ms, hash_ids, input_length=None, output_length=160):
    return {
        "timestamp": ms,
        "input_length": input_length or 512 * len(hash_ids),
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def turn_of(tokens, request=0):
    return Turn(request, 0, 0, 0.0, tuple(tokens), len(tokens), 1)


def brute_force_reuse(prompts, page_size):
    out = []
    for i, tokens in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            common = 0
            while common < min(len(tokens), len(earlier)) and tokens[common] == earlier[common]:
                common += 1
            best = max(best, common // page_size * page_size)
        out.append(min(best, (len(tokens) - 1) // page_size * page_size))
    return out


# ---- the oracle


def test_ideal_reuse_counts_whole_shared_pages_of_earlier_prompts_never_the_whole_prompt():
    base = list(range(100, 120))
    prompts = [
        base,  # first: nothing earlier
        base[:12] + [7, 7, 7, 7],  # shares 12 tokens = 3 pages of 4
        base[:11] + [9],  # shares 11 tokens: 2 whole pages
        base,  # identical to an earlier prompt: capped below its last token (16 of 20)
        base[:8],  # a prefix of earlier prompts, 8 tokens: capped at 4
        [1, 2, 3],  # shorter than a page
        list(base[:12]) + [7, 7, 7, 7, 5],  # extends request 1 (16 shared)
    ]
    turns = [turn_of(p, i) for i, p in enumerate(prompts)]
    assert ideal_reuse(turns, 4) == [0, 12, 8, 16, 4, 0, 16]
    assert ideal_reuse(turns, 4) == brute_force_reuse(prompts, 4)


prompt_sets = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 30), st.lists(st.integers(0, 2), max_size=12)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(prompt_sets, st.integers(1, 5))
def test_ideal_reuse_equals_brute_force_on_random_traces(specs, page_size):
    """Prompts built from an earlier prompt's prefix plus a random tail (a tiny alphabet, so
    accidental matches happen too)."""
    prompts: list[list[int]] = []
    for source, keep, tail in specs:
        head = prompts[source % len(prompts)][:keep] if prompts else []
        prompts.append(head + tail or [0])
    turns = [turn_of(p, i) for i, p in enumerate(prompts)]
    assert ideal_reuse(turns, page_size) == brute_force_reuse(prompts, page_size)


# ---- sessions


def test_a_request_continues_the_latest_request_sharing_its_longest_prefix_beyond_block_zero():
    lineages = derive_sessions(
        [
            [0, 1, 2],  # 0: opens session 0
            [0, 3, 4],  # 1: shares only block 0 with 0: opens session 1
            [0, 1, 2, 5],  # 2: continues 0
            [0, 1, 2, 5, 6],  # 3: continues 2
            [0, 3, 7],  # 4: continues 1 (shares 2 blocks)
            [0, 1, 8],  # 5: shares 2 blocks with 0, 2 and 3: the latest, 3 (a branch)
            [0, 9],  # 6: opens session 2
        ]
    )
    assert [tuple(x) for x in lineages] == [
        (None, 0, 0),
        (None, 1, 0),
        (0, 0, 1),
        (2, 0, 2),
        (1, 1, 1),
        (3, 0, 3),
        (None, 2, 0),
    ]
    assert derive_sessions([[0, 1], [0, 1, 2]], min_shared_blocks=3)[1].parent is None


def test_sessions_of_a_hand_made_trace(tmp_path, held_out):
    trace = write_jsonl(
        tmp_path / "t.jsonl",
        [
            request(0, [0, 1, 2]),
            request(1000, [0, 3]),
            request(2500, [0, 1, 2, 4]),
            request(3000, [0, 5]),
            request(4000, [0, 5, 6]),
            request(5000, [0, 1, 2, 4, 7]),
            request(6000, [0, 8]),  # a session of one turn: left out with min_turns 2
        ],
    )
    config = WorkloadConfig(trace=trace, scale=16, page_size=8, max_prompt_tokens=None)
    turns = load_workload(config, code_points, held_out)
    assert [(t.session, t.turn) for t in turns] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]
    assert [t.arrival_s for t in turns] == [0.0, 2.5, 3.0, 4.0, 5.0]
    assert [t.request for t in turns] == list(range(5))
    assert [t.new_tokens for t in turns] == [96, 32, 64, 32, 32]  # whole prompt, then one block
    assert all(t.text is None for t in turns)
    assert turns[1].tokens[:96] == turns[0].tokens and turns[4].tokens[:128] == turns[1].tokens


# ---- text


def test_repeated_block_ids_are_identical_tokens_and_distinct_ids_distinct(tmp_path, held_out):
    trace = write_jsonl(
        tmp_path / "t.jsonl", [request(0, [0, 1, 2]), request(1, [0, 1, 3]), request(2, [0, 4])]
    )
    config = WorkloadConfig(trace=trace, scale=8, min_turns=1, max_prompt_tokens=None)
    turns = load_workload(config, code_points, held_out)
    blocks = [[t.tokens[i : i + 64] for i in range(0, len(t.tokens), 64)] for t in turns]
    assert blocks[0][:2] == blocks[1][:2] and blocks[0][0] == blocks[2][0]
    by_id = {0: blocks[0][0], 1: blocks[0][1], 2: blocks[0][2], 3: blocks[1][2], 4: blocks[2][1]}
    windows = [set(tokens) for tokens in by_id.values()]
    assert all(len(a & b) == 0 for i, a in enumerate(windows) for b in windows[i + 1 :])
    assert load_workload(config, code_points, held_out) == turns  # deterministic


def test_the_stream_wraps_around_when_the_held_out_text_runs_out(tmp_path):
    (tmp_path / "short.txt").write_text("".join(map(chr, range(300, 340))))  # 40 tokens
    trace = write_jsonl(tmp_path / "t.jsonl", [request(0, [0, 1, 2])])
    config = WorkloadConfig(trace=trace, scale=16, min_turns=1, page_size=8)
    (turn,) = load_workload(config, code_points, [tmp_path / "short.txt"])
    assert turn.tokens == tuple(range(300, 340)) + tuple(range(300, 340)) + tuple(range(300, 316))


def test_held_out_files_are_read_only_as_far_as_the_prompts_reach(tmp_path, held_out):
    trace = write_jsonl(tmp_path / "t.jsonl", [request(0, [0, 1])])
    missing = tmp_path / "never-read.txt"
    config = WorkloadConfig(trace=trace, scale=16, min_turns=1, page_size=8)
    assert len(load_workload(config, code_points, [*held_out, missing])[0].tokens) == 64


def test_scale_divides_block_size_and_every_length(tmp_path, held_out):
    rows = [request(0, [0, 1, 2], 1100, 300), request(10, [0, 1, 2, 3], 1700, 7)]
    trace = write_jsonl(tmp_path / "t.jsonl", rows)
    for scale in (4, 16, 64):
        config = WorkloadConfig(trace=trace, scale=scale, max_prompt_tokens=None, page_size=8)
        turns = load_workload(config, code_points, held_out)
        assert [len(t.tokens) for t in turns] == [1100 // scale, 1700 // scale]
        assert [t.output_tokens for t in turns] == [300 // scale, max(1, 7 // scale)]
        assert turns[1].tokens[: len(turns[0].tokens)] == turns[0].tokens  # blocks 0, 1, 2
        assert turns[1].new_tokens == len(turns[1].tokens) - len(turns[0].tokens)


def test_a_block_that_is_not_whole_pages_is_refused():
    with pytest.raises(KVMapError, match="page size 8"):
        WorkloadConfig(scale=128, page_size=8)
    with pytest.raises(KVMapError, match="page size 16"):
        WorkloadConfig(scale=3, page_size=16)  # 170-token blocks
    with pytest.raises(KVMapError, match="max_turns"):
        WorkloadConfig(min_turns=5, max_turns=3)
    with pytest.raises(KVMapError, match="sessions"):
        WorkloadConfig(sessions=0)


def test_the_slice_keeps_sessions_of_min_turns_below_max_turns_and_the_prompt_cap(
    tmp_path, held_out
):
    rows = [
        request(0, [0, 1]),
        request(1, [0, 1, 2]),
        request(2, [0, 1, 2, 3]),
        request(3, [0, 1, 2, 3, 4]),  # 160 tokens at scale 16
        request(4, [0, 5]),
        request(5, [0, 5, 6]),
        request(6, [0, 7, 8, 9, 10, 11]),  # a first turn of 192 tokens
        request(7, [0, 7, 8, 9, 10, 11, 12]),
    ]
    trace = write_jsonl(tmp_path / "t.jsonl", rows)
    cut = WorkloadConfig(trace=trace, scale=16, max_turns=3, max_prompt_tokens=128, page_size=8)
    assert [(t.session, t.turn) for t in load_workload(cut, code_points, held_out)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
    ]
    first = WorkloadConfig(
        trace=trace, scale=16, sessions=1, min_turns=4, max_prompt_tokens=None, page_size=8
    )
    assert len(load_workload(first, code_points, held_out)) == 4
    with pytest.raises(KVMapError, match="min_turns"):
        load_workload(
            WorkloadConfig(trace=trace, scale=16, min_turns=4, max_prompt_tokens=128, page_size=8),
            code_points,
        )


def test_the_default_slice_of_the_bundled_trace_is_small_and_multi_turn(held_out):
    assert DEFAULT_TRACE.is_file() and (DEFAULT_TRACE.parent / "LICENSE-APACHE-mooncake").is_file()
    config = WorkloadConfig()
    turns = load_workload(config, code_points, held_out)
    summary = summarize(turns, config.page_size)
    assert summary.sessions == config.sessions and 20 <= summary.requests <= 48
    assert summary.max_prompt_tokens <= config.max_prompt_tokens
    assert 0.3 < summary.ideal_reuse_share < 0.8
    assert [t.request for t in turns] == list(range(len(turns)))
    assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)
    sessions = [t.session for t in turns]
    assert sorted(set(sessions), key=sessions.index) == list(range(config.sessions))
    for s in range(config.sessions):
        mine = [t.turn for t in turns if t.session == s]
        assert mine == list(range(len(mine))) and 2 <= len(mine) <= config.max_turns


def test_distinct_openings_give_each_session_its_own_first_block(held_out):
    """``openings="distinct"`` on the bundled trace: the same slice (sessions, turns, lengths,
    arrivals); no two sessions share their first block any more, while each session's turns
    still share their prefix as before, and the slice has no shared opening to warm."""
    shared = load_workload(WorkloadConfig(), code_points, held_out)
    distinct = load_workload(WorkloadConfig(openings="distinct"), code_points, held_out)
    block = WorkloadConfig().block_tokens
    same = [(t.session, t.turn, len(t.tokens), t.arrival_s, t.new_tokens) for t in shared]
    assert [(t.session, t.turn, len(t.tokens), t.arrival_s, t.new_tokens) for t in distinct] == same
    assert len({t.tokens[:block] for t in shared}) == 1
    firsts = {t.session: t.tokens[:block] for t in distinct}
    assert len(set(firsts.values())) == len(firsts)
    assert all(t.tokens[:block] == firsts[t.session] for t in distinct)
    assert all(a.tokens[block:] == b.tokens[block:] for a, b in zip(shared, distinct))
    assert shared_opening(distinct, WorkloadConfig().page_size) == ()
    with pytest.raises(KVMapError, match="openings must be one of"):
        WorkloadConfig(openings="per-user")


# ---- the agentic trace


def agentic_trace(path):
    conversations = [
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Fix the bug."},
                ],
                "prompt_tokens": 900,
            },
            {"messages": [{"role": "tool", "content": "ok"}], "output_tokens": 32},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Now test."}]}]},
        ],
        [{"messages": [{"role": "user", "content": "Hi"}]}],  # one turn: left out
        [
            {"messages": [{"role": "user", "content": "Plan it."}]},
            {"messages": []},  # no new messages: skipped, as SGLang does
            {"messages": [{"role": "user", "content": "Go on."}]},
        ],
    ]
    path.write_text(json.dumps({"metadata": {}, "conversations": conversations}))
    return str(path)


def test_agentic_turns_grow_by_an_answer_stand_in_and_the_new_messages(tmp_path, held_out):
    config = WorkloadConfig(
        trace=agentic_trace(tmp_path / "a.json"), scale=1, max_prompt_tokens=None, page_size=8
    )
    turns = load_workload(config, code_points, held_out)
    assert [(t.session, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    assert [t.request for t in turns] == list(range(5))
    first, second, third = (t for t in turns if t.session == 0)
    assert first.tokens == tuple(map(ord, "system: Be brief.\nuser: Fix the bug.\n"))
    answer = second.tokens[len(first.tokens) : len(first.tokens) + 220]  # the default output
    assert second.tokens == first.tokens + answer + tuple(map(ord, "tool: ok\n"))
    assert set(answer) <= set(range(1000, 4000)) and second.new_tokens == 220 + 9
    assert third.tokens[: len(second.tokens)] == second.tokens
    assert third.new_tokens == 32 + len("user: Now test.\n")  # the answer of 32 tokens
    assert [t.text for t in turns] == [
        "Fix the bug.",
        "Plan it.",
        "tool: ok\n",
        "Go on.",
        "Now test.",
    ]
    other_answer = turns[3].tokens[len(turns[1].tokens) :][:220]
    assert not set(other_answer) & set(answer)  # each (session, turn) has its own stand-in


def test_a_mooncake_continuation_is_the_held_out_text_right_after_the_prompt(tmp_path, held_out):
    """The stand-in tokenizer gives token ids that are the held-out characters in stream order
    (1000, 1001, ...), so the true next tokens of a prompt are its last token's successors:
    within its last block, and across the block's end into the stream's next window."""
    rows = [request(0, [0, 1, 2], 600), request(10, [0, 1, 2, 3], 1024)]  # 150, 256 tokens
    trace = write_jsonl(tmp_path / "t.jsonl", rows)
    config = WorkloadConfig(trace=trace, scale=4, max_prompt_tokens=None, page_size=8)
    first, second = load_workload(config, code_points, held_out)
    for turn in (first, second):
        last = turn.tokens[-1]
        assert turn.continuation == tuple(range(last + 1, last + 33))
    assert first.tokens[-1] == 1000 + 149  # mid block 1: the rest of block 1 follows
    assert second.continuation[0] == 1000 + 2 * 128  # block 1 ends: the next window (block 2)
    assert second.tokens[: len(first.tokens) + 32][-32:] == first.continuation  # the next turn


def test_an_agentic_continuation_is_the_answer_the_next_turn_carries(tmp_path, held_out):
    config = WorkloadConfig(
        trace=agentic_trace(tmp_path / "a.json"),
        scale=1,
        max_prompt_tokens=None,
        page_size=8,
        continuation_tokens=40,
    )
    turns = load_workload(config, code_points, held_out)
    first, second, _ = (t for t in turns if t.session == 0)
    assert len(first.continuation) == 40
    assert second.tokens[len(first.tokens) : len(first.tokens) + 40] == first.continuation


@pytest.mark.parametrize("tokens", [0, -1, 4097, 1.5, True])
def test_a_continuation_length_out_of_range_is_refused(tokens):
    with pytest.raises(KVMapError, match="continuation_tokens"):
        WorkloadConfig(continuation_tokens=tokens)


def test_agentic_scale_cuts_answers_and_messages(tmp_path, held_out):
    config = WorkloadConfig(
        trace=agentic_trace(tmp_path / "a.json"), scale=4, max_prompt_tokens=None, page_size=8
    )
    first, _, second, *_ = load_workload(config, code_points, held_out)
    messages = len("system: Be brief.\nuser: Fix the bug.\n")
    assert len(first.tokens) == messages // 4 and first.output_tokens == 220 // 4
    assert second.new_tokens == 220 // 4 + len("tool: ok\n") // 4


# ---- bad files


@pytest.mark.parametrize(
    "content",
    [
        "",
        "[1, 2, 3]",
        '{"requests": []}',
        '{"timestamp": 0, "input_length": 10}\n',
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\n',
        "not json at all\n",
        '{"conversations": [{"messages": "hello"}]}',
    ],
)
def test_a_file_of_neither_shape_is_refused_with_what_was_expected(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(KVMapError, match="hash_ids|conversations") as error:
        load_workload(WorkloadConfig(trace=str(path)), code_points)
    assert "\n" not in str(error.value)


def test_a_missing_trace_is_refused(tmp_path):
    with pytest.raises(KVMapError, match="does not exist"):
        load_workload(WorkloadConfig(trace=str(tmp_path / "nope.jsonl")), code_points)


def mooncake_line(**fields):
    row = request(0, [0, 1])
    row.update(fields)
    return json.dumps(row) + "\n"


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (mooncake_line(input_length=0), "input_length must be at least 1"),
        (mooncake_line(input_length=-5), "input_length must be at least 1"),
        (mooncake_line(output_length=0), "output_length must be at least 1"),
        (mooncake_line(hash_ids="123"), "hash_ids must be a non-empty list"),
        (mooncake_line(hash_ids=[0, True]), "a hash id must be a whole number"),
        (mooncake_line(hash_ids=[0, -1]), "a hash id must be at least 0"),
        (mooncake_line(input_length=True), "input_length must be a whole number"),
        (mooncake_line(input_length=10.5), "input_length must be a whole number"),
        (mooncake_line(input_length="10"), "input_length must be a whole number"),
        (mooncake_line(timestamp="soon"), "timestamp must be a number"),
        (mooncake_line(timestamp=-1), "timestamp must be a number"),
        (
            '{"timestamp": 1e400, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n',
            "1e400 is out of range",
        ),
        (
            '{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n',
            "NaN is not a number",
        ),
        ("[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
        ('"just a string"\n', "not a JSON object"),
    ],
)
def test_a_mooncake_line_with_bad_values_is_refused_naming_the_field(tmp_path, line, named):
    """Before: lengths <= 0 became silent one-token prompts, "123" was read as blocks 1, 2, 3,
    booleans and fractions were truncated, 1e400 and deep nesting raised tracebacks."""
    path = tmp_path / "bad.jsonl"
    path.write_text(mooncake_line() + line)
    with pytest.raises(KVMapError, match=f"line 2 is not a trace request: {named}") as error:
        load_workload(WorkloadConfig(trace=str(path)), code_points)
    assert "\n" not in str(error.value)


def test_whole_floats_are_read_as_the_integers_they_are(tmp_path, held_out, monkeypatch):
    from sgl_kvmap.bench import workload

    monkeypatch.setattr(workload, "held_out_files", lambda: held_out)
    path = tmp_path / "trace.jsonl"
    rows = [request(0.0, [0, 1]), {**request(5, [0, 1, 2]), "input_length": 1536.0}]
    write_jsonl(path, rows)
    turns = load_workload(WorkloadConfig(trace=str(path), sessions=1, scale=8), code_points)
    assert [len(t.tokens) for t in turns] == [128, 192]


def test_a_trace_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(mooncake_line().encode() + b'{"note": "caf\xe9"}\n')
    with pytest.raises(KVMapError, match="is not UTF-8 text") as error:
        load_workload(WorkloadConfig(trace=str(path)), code_points)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "turn",
    [
        {"messages": [{"role": 1, "content": "hi"}]},
        {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        {"messages": [{"role": "user", "content": [{"text": 5}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "output_tokens": "many"},
        {"messages": [{"role": "user", "content": "hi"}], "output_tokens": [3]},
        {"messages": [{"role": "user", "content": "hi"}], "completion_tokens": -3},
    ],
)
def test_an_agentic_turn_of_wrong_types_is_refused_in_one_line(tmp_path, turn):
    """Before: wrong types inside a turn raised TypeError/ValueError tracebacks mid-build."""
    path = tmp_path / "agentic.json"
    path.write_text(json.dumps({"conversations": [[turn, turn]]}))
    with pytest.raises(KVMapError, match="conversations") as error:
        load_workload(WorkloadConfig(trace=str(path)), code_points)
    assert "\n" not in str(error.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "hash_id"]),
    value=json_values,
)
def test_fuzz_any_value_in_any_mooncake_field_gives_a_workload_or_one_line(field, value):
    """Property: a trace with one field (or one hash id) replaced by any JSON value loads or is
    refused with one KVMapError line; nothing else escapes."""
    rows = [request(0, [0, 1]), request(5, [0, 1, 2])]
    if field == "hash_id":
        rows[1]["hash_ids"][1] = value
    else:
        rows[1][field] = value
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        path.write_text("".join(json.dumps(row, allow_nan=True) + "\n" for row in rows))
        try:
            load_workload(WorkloadConfig(trace=str(path), sessions=1, scale=8), code_points)
        except KVMapError as error:
            assert "\n" not in str(error)

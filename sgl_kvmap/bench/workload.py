"""The requests ``sgl-kvmap bench`` replays: sessions of a request trace, filled with real text.

Two trace shapes, detected from the file:

- the Mooncake trace (JSON lines with ``timestamp`` ms, ``input_length``, ``output_length`` and
  ``hash_ids``, one id per 512-token prefix block; the bundled default, ``DEFAULT_TRACE``);
- SGLang's agentic trace (a JSON object ``{"conversations": [[{"messages": [...]}, ...], ...]}``
  whose turns hold only the messages new in that turn).

Sessions (Mooncake has no session ids). Every request of the trace opens with block 0; beyond
it, unrelated requests almost never share a block, and a request that shares two or more
blocks with an earlier one is nearly always that request's next turn (docs/LOG.md, the bench
entry of 2026-12-04, has the counts). So a request continues the session of the latest earlier
request with which it shares the longest common hash-id prefix, when that prefix is at least
``SESSION_MIN_SHARED_BLOCKS`` (2) blocks; its turn is that request's turn + 1. Otherwise it
opens a session (turn 0). Branches (two requests continuing one request) keep the rule: both
get the parent's turn + 1.

Text. Each distinct block id of the slice gets its own window of held-out token ids
(``fitting.texts.default_eval_files``, shuffled, tokenized lazily file by file), so a repeated
block id is the same tokens and distinct ids are disjoint windows of the stream (until the
stream runs out; then windows wrap around). A Mooncake prompt is its blocks' tokens, truncated
to its (scaled) ``input_length``. An agentic prompt of turn t is the prompt of turn t-1, then a
stand-in for the previous answer (the previous turn's output length, scaled, of held-out text,
consecutive windows in (session, turn) order), then this turn's new messages as plain
``"role: content\\n"`` text, tokenized and cut to ``len // scale`` tokens. Agentic traces carry
no arrival times: their turns come round by round (every session's turn 0, then turn 1, ...)
with ``arrival_s`` 0.0, and the output length is a turn's ``output_tokens`` or
``completion_tokens`` when present, else ``DEFAULT_AGENTIC_OUTPUT_TOKENS`` (SGLang's default).

True next tokens. Each request keeps ``continuation_tokens`` tokens of held-out text that follow
its prompt, which the benchmark scores answers on (``Turn.continuation``): for a Mooncake
prompt, the stream after its last token (the rest of its last block, then the text that follows
that block in the stream); for an agentic prompt, the stand-in of this turn's answer (the text
the next turn's prompt carries as the previous answer).

Openings. ``openings="distinct"`` gives each session of a Mooncake trace an opening of its own:
its block 0, which every request of the trace shares (a system prompt), is replaced in all of
its turns by a block id no other session has, as traffic with per-user system prompts or a
retrieved document first would be. Sessions are derived before the replacement, so the slice
and its turns are the same; only what the sessions share changes.

Scale. ``scale`` S divides the block size (512 // S tokens) and every length (at least 1), so a
CPU can replay the trace's reuse structure at 1/S of its length.

Slice. The first ``sessions`` sessions (in order of first arrival) that keep at least
``min_turns`` turns, where a session keeps its turns below ``max_turns`` whose prompts fit in
``max_prompt_tokens`` (after scaling) and whose previous turn was kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import NamedTuple

from ..core.errors import KVMapError
from ..core.strict_json import loads_finite
from ..sglang.launch import PAGE_SIZE

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's prefix block
DEFAULT_TRACE = Path(__file__).with_name("data") / "mooncake_conversation_trace.jsonl"
SESSION_MIN_SHARED_BLOCKS = 2  # block 0 opens every request: sharing it says nothing
CONTINUATION_TOKENS = 32  # true next tokens scored per request
MAX_CONTINUATION_TOKENS = 4096
DEFAULT_AGENTIC_OUTPUT_TOKENS = 220  # sglang.benchmark.datasets.agentic_trace's default
AGENTIC_OUTPUT_KEYS = ("output_tokens", "completion_tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
OPENINGS = ("shared", "distinct")
EXPECTED_SHAPES = (
    "JSON lines with timestamp, input_length, output_length and hash_ids (the Mooncake trace) "
    'or a JSON object with "conversations" (SGLang\'s agentic trace)'
)


@dataclass(frozen=True)
class Turn:
    """One request of the replayed slice."""

    request: int  # index in the replayed slice, arrival order (0..n-1)
    session: int  # 0..sessions-1 in order of first arrival
    turn: int  # 0 for a session's first request
    arrival_s: float  # seconds after the slice's first request
    tokens: tuple[int, ...]  # the prompt's token ids
    new_tokens: int  # tokens beyond the previous turn's prompt (the whole prompt on turn 0)
    output_tokens: int  # the trace's (scaled) answer length
    text: str | None = None  # the last user message's text when the trace has text, else None
    continuation: tuple[int, ...] = ()  # the held-out text right after the prompt (its true next
    # tokens, ``WorkloadConfig.continuation_tokens``): what the benchmark scores answers on


@dataclass(frozen=True)
class WorkloadConfig:
    """Which trace, at what scale, and which slice of it (see the module docstring)."""

    trace: str | None = None  # None: DEFAULT_TRACE (the bundled Mooncake trace)
    scale: int = 8
    sessions: int = 10
    min_turns: int = 2
    max_turns: int = 4
    max_prompt_tokens: int | None = 768  # after scaling; None: no cap
    page_size: int = PAGE_SIZE  # sglang-args'; blocks of 512 / scale tokens must fill pages
    continuation_tokens: int = CONTINUATION_TOKENS  # true next tokens kept per request
    openings: str = "shared"  # or "distinct": each session its own block 0 (module docstring)

    def __post_init__(self):
        if self.openings not in OPENINGS:
            raise KVMapError(f"openings must be one of {OPENINGS}, got {self.openings!r}")
        for name in (
            "scale",
            "sessions",
            "min_turns",
            "max_turns",
            "page_size",
            "continuation_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVMapError(
                    f"workload {name} must be a positive integer, got {getattr(self, name)!r}"
                )
        if self.continuation_tokens > MAX_CONTINUATION_TOKENS:
            raise KVMapError(
                f"continuation_tokens {self.continuation_tokens} is above {MAX_CONTINUATION_TOKENS}"
            )
        if self.max_turns < self.min_turns:
            raise KVMapError(f"max_turns {self.max_turns} is below min_turns {self.min_turns}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise KVMapError(
                f"max_prompt_tokens must be positive or None, got {self.max_prompt_tokens}"
            )
        if self.block_tokens < self.page_size or self.block_tokens % self.page_size:
            raise KVMapError(
                f"scale {self.scale} makes the trace's {TRACE_BLOCK_TOKENS}-token blocks "
                f"{self.block_tokens} tokens, not a multiple of the page size {self.page_size}; "
                f"choose a scale that divides {TRACE_BLOCK_TOKENS // self.page_size}"
            )

    @property
    def block_tokens(self) -> int:
        """Tokens of one prefix block after scaling."""
        return TRACE_BLOCK_TOKENS // self.scale

    @property
    def trace_path(self) -> Path:
        return Path(self.trace) if self.trace is not None else DEFAULT_TRACE

    def scaled(self, length: int) -> int:
        """A trace length after scaling (at least 1)."""
        return max(1, length // self.scale)

    def fits(self, prompt_tokens: int) -> bool:
        return self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens


def load_workload(
    config: WorkloadConfig, tokenizer, text_files: Sequence[Path] | None = None
) -> list[Turn]:
    """The slice of ``config.trace`` that the benchmark replays, in arrival order, its prompts
    tokenized with ``tokenizer`` (a Hugging Face tokenizer or any callable returning
    ``{"input_ids": [...]}``); ``text_files``: the held-out text (default: the shuffled
    ``default_eval_files()``)."""
    text = read_trace_text(config.trace_path)
    stream = TokenStream(tokenizer, held_out_files() if text_files is None else text_files)
    conversations = agentic_conversations(text, config.trace_path)
    if conversations is not None:
        if config.openings != "shared":
            raise KVMapError(
                f"openings {config.openings!r} applies to Mooncake traces; an agentic trace's "
                "sessions open with their own messages"
            )
        return agentic_workload(conversations, config, tokenizer, stream)
    return mooncake_workload(mooncake_requests(text, config.trace_path), config, stream)


def held_out_files() -> list[Path]:
    from ..fitting.texts import default_eval_files, shuffled

    return shuffled(default_eval_files())


def read_trace_text(path: Path) -> str:
    if not path.is_file():
        raise KVMapError(f"trace {path} does not exist; expected {EXPECTED_SHAPES}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise KVMapError(
            f"trace {path} is not UTF-8 text (byte {error.start}); expected {EXPECTED_SHAPES}"
        ) from None


def shown(value) -> str:
    """``repr(value)``, cut to 60 characters for an error line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def whole_number(value, what: str, minimum: int) -> int:
    """``value`` if it is an integer (a JSON integer, or a float with no fraction) of at least
    ``minimum``; booleans, strings and fractions are refused. Raises ValueError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, not {shown(value)}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, not {value}")
    return value


# ---- held-out text ----------------------------------------------------------------------------


class TokenStream:
    """Held-out token ids as one stream: files tokenized one by one, only as far as a window
    reaches; windows past the end of the last file wrap around to the start."""

    def __init__(self, tokenizer, files: Iterable[Path]):
        self._tokenizer = tokenizer
        self._files: Iterator[Path] = iter(files)
        self._ids: list[int] = []

    def window(self, start: int, length: int) -> tuple[int, ...]:
        """Token ids ``[start, start + length)`` of the stream (modulo its length once every
        file has been read)."""
        self._read_until(start + length)
        if start + length <= len(self._ids):
            return tuple(self._ids[start : start + length])
        if not self._ids:
            raise KVMapError("the held-out text files hold no tokens to fill prompts with")
        return tuple(self._ids[(start + k) % len(self._ids)] for k in range(length))

    def _read_until(self, tokens: int) -> None:
        from ..fitting.texts import file_tokens

        while len(self._ids) < tokens:
            path = next(self._files, None)
            if path is None:
                return
            self._ids += file_tokens(self._tokenizer, path)


def tokenize(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- the Mooncake trace -----------------------------------------------------------------------


class MooncakeRequest(NamedTuple):
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class Lineage(NamedTuple):
    """Where a trace request sits in its session."""

    parent: int | None  # trace index of the request it continues (None: it opens a session)
    session: int  # trace-wide, in order of first arrival
    turn: int


def mooncake_requests(text: str, path: Path) -> list[MooncakeRequest]:
    """The requests of a Mooncake JSONL trace, in arrival order (stable by timestamp)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise KVMapError(f"trace {path} is empty; expected {EXPECTED_SHAPES}")
    requests = [_mooncake_request(line, path, number) for number, line in enumerate(lines, 1)]
    return sorted(requests, key=lambda r: r.timestamp_ms)


def _mooncake_request(line: str, path: Path, number: int) -> MooncakeRequest:
    try:
        row = loads_finite(line)
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
        missing = [key for key in MOONCAKE_KEYS if key not in row]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        timestamp = row["timestamp"]
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
            raise ValueError(f"timestamp must be a number of ms >= 0, not {shown(timestamp)}")
        hash_ids = row["hash_ids"]
        if not isinstance(hash_ids, list) or not hash_ids:
            raise ValueError(f"hash_ids must be a non-empty list of ids, not {shown(hash_ids)}")
        request = MooncakeRequest(
            float(timestamp),
            whole_number(row["input_length"], "input_length", minimum=1),
            whole_number(row["output_length"], "output_length", minimum=1),
            tuple(whole_number(b, "a hash id", minimum=0) for b in hash_ids),
        )
    except ValueError as error:
        raise KVMapError(
            f"trace {path} line {number} is not a trace request: {error}; "
            f"expected {EXPECTED_SHAPES}"
        ) from None
    return request


def derive_sessions(
    hash_ids: Sequence[Sequence[int]], min_shared_blocks: int = SESSION_MIN_SHARED_BLOCKS
) -> list[Lineage]:
    """Sessions of requests given only their prefix-block ids (arrival order): a request continues
    the latest earlier request sharing its longest common block prefix, when that prefix has at
    least ``min_shared_blocks`` blocks (a trie of block ids: linear in the blocks)."""
    children: dict[tuple[int, int], int] = {}  # (trie node, block id) -> trie node
    latest: dict[int, int] = {}  # trie node -> latest request whose prefix passes through it
    lineages: list[Lineage] = []
    sessions = 0
    for request, ids in enumerate(hash_ids):
        node, depth = _deepest_match(children, ids)
        if depth >= min_shared_blocks:
            parent = latest[node]
            lineages.append(Lineage(parent, lineages[parent].session, lineages[parent].turn + 1))
        else:
            lineages.append(Lineage(None, sessions, 0))
            sessions += 1
        for node in _insert_path(children, ids):
            latest[node] = request
    return lineages


def _deepest_match(children: dict[tuple[int, object], int], keys: Iterable) -> tuple[int, int]:
    """The trie node at the end of the longest stored prefix of ``keys``, and its depth."""
    node, depth = 0, 0
    for key in keys:
        child = children.get((node, key))
        if child is None:
            break
        node, depth = child, depth + 1
    return node, depth


def _insert_path(children: dict[tuple[int, object], int], keys: Iterable) -> list[int]:
    """Store ``keys`` as a path from the root (node 0); the nodes along it."""
    node, path = 0, []
    for key in keys:
        node = children.setdefault((node, key), len(children) + 1)
        path.append(node)
    return path


def mooncake_prompt_length(request: MooncakeRequest, config: WorkloadConfig) -> int:
    """The scaled input length, never beyond the request's blocks."""
    return min(config.scaled(request.input_length), len(request.hash_ids) * config.block_tokens)


def select_requests(
    lineages: Sequence[Lineage], prompt_lengths: Sequence[int], config: WorkloadConfig
) -> list[int]:
    """Trace indexes of the slice (see the module docstring), in arrival order."""
    kept: set[int] = set()
    by_session: dict[int, list[int]] = {}
    for index, (parent, session, turn) in enumerate(lineages):
        continues = parent is None or parent in kept
        if continues and turn < config.max_turns and config.fits(prompt_lengths[index]):
            kept.add(index)
            by_session.setdefault(session, []).append(index)
    chosen = [s for s in by_session.values() if len(s) >= config.min_turns][: config.sessions]
    if not chosen:
        raise KVMapError(
            f"no session of {config.trace_path} has {config.min_turns} turns of at most "
            f"{config.max_prompt_tokens} tokens at scale {config.scale}; lower min_turns or "
            "raise max_prompt_tokens"
        )
    return sorted(chain.from_iterable(chosen))


def block_slots(block_ids: Iterable[int]) -> dict[int, int]:
    """Each distinct block id's window number in the stream (in id order): block ``b``'s tokens
    are the stream's ``[slot * block_tokens, (slot + 1) * block_tokens)``."""
    return {block: slot for slot, block in enumerate(sorted(set(block_ids)))}


def block_windows(
    stream: TokenStream, slots: dict[int, int], block_tokens: int
) -> dict[int, tuple[int, ...]]:
    """Each block id's own window ``[block_tokens]`` of the stream (``block_slots``)."""
    return {
        block: stream.window(slot * block_tokens, block_tokens) for block, slot in slots.items()
    }


def mooncake_continuation(
    stream: TokenStream,
    slots: dict[int, int],
    hash_ids: Sequence[int],
    prompt_tokens: int,
    config: WorkloadConfig,
) -> tuple[int, ...]:
    """The ``config.continuation_tokens`` stream tokens right after a prompt's last token: the
    rest of its last block's text, then the text that follows it in the held-out stream."""
    last = prompt_tokens - 1
    block = hash_ids[last // config.block_tokens]
    at = slots[block] * config.block_tokens + last % config.block_tokens + 1
    return stream.window(at, config.continuation_tokens)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def mooncake_workload(
    requests: Sequence[MooncakeRequest], config: WorkloadConfig, stream: TokenStream
) -> list[Turn]:
    """The slice of a Mooncake trace as turns with prompts of held-out text."""
    lineages = derive_sessions([r.hash_ids for r in requests])
    lengths = [mooncake_prompt_length(r, config) for r in requests]
    chosen = select_requests(lineages, lengths, config)
    slots = block_slots(b for i in chosen for b in requests[i].hash_ids)
    if config.openings == "distinct":  # the other blocks keep their text
        requests = distinct_openings(requests, lineages)
        for block in sorted({requests[i].hash_ids[0] for i in chosen}):
            slots[block] = len(slots)
    blocks = block_windows(stream, slots, config.block_tokens)
    prompts = {
        i: tuple(chain.from_iterable(blocks[b] for b in requests[i].hash_ids))[: lengths[i]]
        for i in chosen
    }
    sessions = first_arrival_numbers(lineages[i].session for i in chosen)
    start_ms = requests[chosen[0]].timestamp_ms
    turns = []
    for request, index in enumerate(chosen):
        parent, session, turn = lineages[index]
        tokens = prompts[index]
        shared = 0 if parent is None else common_prefix_length(tokens, prompts[parent])
        turns.append(
            Turn(
                request=request,
                session=sessions[session],
                turn=turn,
                arrival_s=(requests[index].timestamp_ms - start_ms) / 1000,
                tokens=tokens,
                new_tokens=len(tokens) - shared,
                output_tokens=config.scaled(requests[index].output_length),
                continuation=mooncake_continuation(
                    stream, slots, requests[index].hash_ids, lengths[index], config
                ),
            )
        )
    return turns


def distinct_openings(
    requests: Sequence[MooncakeRequest], lineages: Sequence[Lineage]
) -> list[MooncakeRequest]:
    """``requests`` with each session's block 0 replaced by a block id of its own, above every
    id of the trace (``lineages``: their sessions)."""
    base = 1 + max(b for r in requests for b in r.hash_ids)
    return [
        r._replace(hash_ids=(base + lineage.session, *r.hash_ids[1:]))
        for r, lineage in zip(requests, lineages)
    ]


def first_arrival_numbers(keys: Iterable[int]) -> dict[int, int]:
    """0, 1, 2, ... for ``keys`` in order of first appearance."""
    numbers: dict[int, int] = {}
    for key in keys:
        numbers.setdefault(key, len(numbers))
    return numbers


# ---- SGLang's agentic trace -------------------------------------------------------------------


def agentic_conversations(text: str, path: Path) -> list[list[dict]] | None:
    """The conversations of an agentic-trace JSON object (each a list of turns with new
    ``messages``), or None when ``text`` is not one JSON object with "conversations"."""
    try:
        data = loads_finite(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or "conversations" not in data:
        return None
    conversations = data["conversations"]
    if not isinstance(conversations, list) or not all(_is_conversation(c) for c in conversations):
        raise KVMapError(
            f'trace {path}: "conversations" must be a list of conversations, each a list of '
            'turns {"messages": [{"role": "...", "content": "..."}, ...]} (content: text, '
            'null or a list of {"text": "..."} parts; output_tokens, when given, a whole number)'
        )
    return conversations


def _is_conversation(conversation) -> bool:
    return isinstance(conversation, list) and all(
        isinstance(turn, dict)
        and isinstance(turn.get("messages", []), list)
        and all(_is_message(m) for m in turn.get("messages", []))
        and all(_is_count(turn.get(key)) for key in AGENTIC_OUTPUT_KEYS)
        for turn in conversation
    )


def _is_message(message) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    if isinstance(content, list):
        return all(
            isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content
        )
    return content is None or isinstance(content, str)


def _is_count(value) -> bool:
    if value is None:
        return True
    try:
        whole_number(value, "a token count", minimum=0)
    except ValueError:
        return False
    return True


def content_text(content) -> str:
    """A message's content as text (OpenAI multi-part content: its text parts joined)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def messages_text(messages: Sequence[dict]) -> str:
    """New messages as plain text, one ``"role: content\\n"`` each."""
    return "".join(f"{m['role']}: {content_text(m.get('content'))}\n" for m in messages)


def last_user_text(messages: Sequence[dict]) -> str:
    """The last user message's content (all the new messages' text when none is a user's)."""
    users = [m for m in messages if m.get("role") == "user"]
    return content_text(users[-1].get("content")) if users else messages_text(messages)


def agentic_output_tokens(turn: dict, config: WorkloadConfig) -> int:
    length = next((turn[key] for key in AGENTIC_OUTPUT_KEYS if turn.get(key)), None)
    return config.scaled(int(length or DEFAULT_AGENTIC_OUTPUT_TOKENS))


class SessionTurns(NamedTuple):
    turns: list[Turn]  # session and request numbers still to be assigned
    answer_tokens: int  # stream tokens the answer stand-ins used


def agentic_session(
    conversation: Sequence[dict],
    config: WorkloadConfig,
    tokenizer,
    stream: TokenStream,
    answers_at: int,
) -> SessionTurns:
    """One conversation's turns (up to max_turns, while prompts fit), answer stand-ins drawn
    from the stream from ``answers_at`` on."""
    turns: list[Turn] = []
    prompt: tuple[int, ...] = ()
    used = 0
    for raw in [t for t in conversation if t.get("messages")][: config.max_turns]:
        message_ids = tokenize(tokenizer, messages_text(raw["messages"]))
        message_ids = message_ids[: config.scaled(len(message_ids))]
        answer_length = turns[-1].output_tokens if turns else 0
        if not config.fits(len(prompt) + answer_length + len(message_ids)):
            break
        answer = stream.window(answers_at + used, answer_length) if answer_length else ()
        used += answer_length
        prompt = prompt + answer + message_ids
        turns.append(
            Turn(
                request=-1,
                session=-1,
                turn=len(turns),
                arrival_s=0.0,
                tokens=prompt,
                new_tokens=len(answer) + len(message_ids),
                output_tokens=agentic_output_tokens(raw, config),
                text=last_user_text(raw["messages"]),
                continuation=stream.window(answers_at + used, config.continuation_tokens),
            )
        )
    return SessionTurns(turns, used)


def agentic_workload(
    conversations: Sequence[Sequence[dict]], config: WorkloadConfig, tokenizer, stream: TokenStream
) -> list[Turn]:
    """The slice of an agentic trace, round by round (every session's turn 0, then turn 1, ...)."""
    sessions: list[list[Turn]] = []
    answers_at = 0
    for conversation in conversations:
        if len(sessions) == config.sessions:
            break
        session = agentic_session(conversation, config, tokenizer, stream, answers_at)
        if len(session.turns) >= config.min_turns:
            sessions.append(session.turns)
            answers_at += session.answer_tokens
    if not sessions:
        raise KVMapError(
            f"no conversation of {config.trace_path} has {config.min_turns} turns of at most "
            f"{config.max_prompt_tokens} tokens at scale {config.scale}; lower min_turns or "
            "raise max_prompt_tokens"
        )
    rounds = sorted(
        ((t.turn, number, t) for number, turns in enumerate(sessions) for t in turns),
        key=lambda item: item[:2],
    )
    return [_numbered(turn, request, session) for request, (_, session, turn) in enumerate(rounds)]


def _numbered(turn: Turn, request: int, session: int) -> Turn:
    return replace(turn, request=request, session=session)


# ---- what an oracle could reuse


def ideal_reuse(turns: list[Turn], page_size: int) -> list[int]:
    """Per request, the tokens an oracle cache shared by both models (infinite, perfect
    translation) could reuse: the longest prefix of its prompt, in whole pages, equal to a prefix
    of an earlier request's prompt, capped at ``(len(tokens) - 1) // page_size * page_size`` (a
    server computes at least the last token). A trie of pages: linear in the prompt tokens."""
    children: dict[tuple[int, object], int] = {}
    reuse = []
    for turn in turns:
        pages = whole_pages(turn.tokens, page_size)
        _, matched = _deepest_match(children, pages)
        reuse.append(min(matched * page_size, (len(turn.tokens) - 1) // page_size * page_size))
        _insert_path(children, pages)
    return reuse


def shared_opening(turns: list[Turn], page_size: int) -> tuple[int, ...]:
    """The opening every prompt of the slice shares (the Mooncake trace's block 0: a system
    prompt), in whole pages, short of every prompt's last token: what each engine could hold
    natively before any session arrives."""
    shortest = min(len(turn.tokens) for turn in turns)
    shared = shortest
    first = turns[0].tokens
    for turn in turns[1:]:
        shared = min(shared, common_prefix_length(first, turn.tokens))
    pages = min(shared, shortest - 1) // page_size
    return tuple(first[: pages * page_size])


def whole_pages(tokens: Sequence[int], page_size: int) -> list[tuple[int, ...]]:
    """``tokens`` cut into pages ``[page_size]``, a partial last page dropped."""
    whole = len(tokens) // page_size * page_size
    return [tuple(tokens[i : i + page_size]) for i in range(0, whole, page_size)]


class WorkloadSummary(NamedTuple):
    requests: int
    sessions: int
    max_turns: int  # the most turns of one session
    prompt_tokens: int  # in all
    mean_prompt_tokens: float
    max_prompt_tokens: int
    ideal_reuse_tokens: int  # in all (ideal_reuse)
    ideal_reuse_share: float  # of all prompt tokens


def summarize(turns: list[Turn], page_size: int) -> WorkloadSummary:
    """What a slice looks like: its size and the share of its prompt tokens an oracle reuses."""
    lengths = [len(t.tokens) for t in turns]
    reuse = sum(ideal_reuse(turns, page_size))
    return WorkloadSummary(
        requests=len(turns),
        sessions=len({t.session for t in turns}),
        max_turns=max(t.turn for t in turns) + 1,
        prompt_tokens=sum(lengths),
        mean_prompt_tokens=sum(lengths) / len(lengths),
        max_prompt_tokens=max(lengths),
        ideal_reuse_tokens=reuse,
        ideal_reuse_share=reuse / sum(lengths),
    )

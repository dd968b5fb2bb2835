"""``sgl-kvmap bench --live``: every (policy, mode) replay against two live SGLang servers.

For each replay both servers start from the command lines ``sgl-kvmap sglang-args`` prints for
the pair (``sglang.launch.engine_commands``, the function behind it, with the same options: page
size, device, KV pool size, the prefetch deadline measured on this machine), over a fresh store,
one after the other (each sees the memory the other took). The store is a fresh folder, or with
``store`` "mooncake" a fresh ``mooncake_master`` on free ports of 127.0.0.1 (the lines of
``sglang-args --store mooncake --mooncake-master 127.0.0.1:PORT``; each server, with its own
client, gets ``MOONCAKE_LOCAL_HOSTNAME=127.0.0.1`` as the recipe asks of every engine's host), the
folder then holding only the servers' counters and the master's log. ``reprefill`` gives neither
engine a pack (KVMapStorage records pages and translates nothing: the target recomputes what it
never cached itself); ``translated`` and ``tail`` give both packs, with ``tail_pages`` 0 and
sgl-kvmap's default tail. The turns go through ``live.replay`` (SGLang's own cached-token
counts per tier, KVMapStorage's counters from its stats file), then both servers stop and the
store is deleted (the master stopped), so nothing one replay cached or translated reaches the
next.

The servers inherit this process's environment, plus ``env``; a CPU engine's lines carry what
SGLang's CPU engine needs (``launch.CPU_ENVIRONMENT``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..sglang.launch import EngineSpec, LaunchOptions, PrefetchDeadline, engine_commands, shell_line
from ..sglang.servers import running_servers
from ..sglang.settings import StorageSettings
from .live import LiveClient, LiveReplay, Reference, replay
from .records import REFERENCE_MODE, RequestRecord
from .replay import ReplayPlan
from .run import BenchConfig, plan
from .workload import Turn, shared_opening

MODE_TAILS = {"translated": 0, "tail": StorageSettings.tail_pages}
ROLES = ("small", "large")


@dataclass(frozen=True)
class LiveSetup:
    """The live servers of a run: the pair's models (``names``: small, large; folders or Hub
    ids) and packs (``packs``: {("small", "large"): folder, ("large", "small"): folder}), what
    ``sglang-args`` is given for them (``options``; its store folder is the parent of each
    replay's store), the first port (the large model's is the next), the prefetch deadline,
    a folder for the servers' logs, variables added to their environment, and the store (file,
    or mooncake: a local master per replay)."""

    names: Mapping[str, str]
    packs: Mapping[tuple[str, str], str]
    options: LaunchOptions
    port: int
    deadline: PrefetchDeadline
    logs: Path
    env: Mapping[str, str] = field(default_factory=dict)
    store: str = "file"


def run_live(
    turns: list[Turn],
    config: BenchConfig,
    setup: LiveSetup,
    on_request: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Every (policy, mode) replay of ``turns`` on live servers; the records in replay order."""
    records = []
    for replay_plan, modes in plan(turns, config):
        references: dict[int, Reference] = {}
        for mode in modes:
            replayed = replay_live(replay_plan, mode, config, setup, references)
            if mode == REFERENCE_MODE:
                references = replayed.answers
            for record in replayed.records:
                records.append(record)
                if on_request:
                    on_request(record)
    return records


def replay_live(
    replay_plan: ReplayPlan,
    mode: str,
    config: BenchConfig,
    setup: LiveSetup,
    references: Mapping[int, Reference],
) -> LiveReplay:
    """One replay on fresh servers over a fresh store (module docstring): its records, and
    (in reprefill) the answers the translating modes are judged against."""
    logs = [setup.logs / f"{replay_plan.policy}-{mode}-{role}.log" for role in ROLES]
    with fresh_store(setup, mode) as (store, store_fields, env):
        options = mode_options(setup, mode, store, config.tail_pages)
        options = dataclasses.replace(options, **store_fields)
        lines = mode_lines(setup, mode, options)
        stats = {role: Path(options.stats_path) / f"{role}_0_1.json" for role in ROLES}
        with running_servers(lines, logs, env) as servers:
            urls = {role: server.url for role, server in zip(ROLES, servers)}
            with LiveClient(urls, stats=stats) as client:
                if config.warm_opening:
                    warm(client, shared_opening(replay_plan.turns, options.page_size))
                return replay(
                    replay_plan.turns,
                    replay_plan.models,
                    replay_plan.swapped,
                    replay_plan.ideal,
                    policy=replay_plan.policy,
                    mode=mode,
                    client=client,
                    references=references if mode != REFERENCE_MODE else None,
                    quality_tokens=config.quality_tokens,
                    page_size=options.page_size,
                )


@contextlib.contextmanager
def fresh_store(setup: LiveSetup, mode: str) -> Iterator[tuple[str, dict, dict]]:
    """A fresh store for one replay (module docstring): its folder (under the options' store
    folder), the ``LaunchOptions`` fields that name it beyond the folder, and the servers'
    extra environment. On exit the master is stopped and the folder deleted."""
    Path(setup.options.store_path).mkdir(parents=True, exist_ok=True)
    store = tempfile.mkdtemp(prefix=f"{mode}-", dir=setup.options.store_path)
    try:
        if setup.store != "mooncake":
            yield store, {}, dict(setup.env)
            return
        from ..sglang.mooncake_master import Master

        with Master(Path(store) / "mooncake_master.log") as master:
            fields = {"store": "mooncake", "mooncake_master": master.address}
            fields["mooncake_metadata"] = master.metadata
            yield store, fields, {**setup.env, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def warm(client: LiveClient, opening: tuple[int, ...]) -> None:
    """Each server serves the shared opening itself (and stores it) before the replay; nothing
    when the prompts share no whole page."""
    for role in ROLES if opening else ():
        client.generate(role, opening, 1, native=True)
        client.settle(role)


def mode_options(
    setup: LiveSetup, mode: str, store: str, tail_pages: int = MODE_TAILS["tail"]
) -> LaunchOptions:
    """The launch options of ``mode``'s replay over the store folder ``store`` (``tail_pages``:
    what the ``tail`` mode recomputes)."""
    tail = tail_pages if mode == "tail" else MODE_TAILS.get(mode, 0)
    return dataclasses.replace(setup.options, store_path=store, tail_pages=tail)


def mode_lines(setup: LiveSetup, mode: str, options: LaunchOptions) -> list[str]:
    """Both servers' command lines for ``mode`` (small, then large), as ``sgl-kvmap
    sglang-args`` prints them for these options: no pack in ``reprefill``, both otherwise."""
    engines = [EngineSpec(setup.names[role], role, setup.port + i) for i, role in enumerate(ROLES)]
    packs = [] if mode == REFERENCE_MODE else [setup.packs[pair] for pair in sorted(setup.packs)]
    return [shell_line(argv) for argv in engine_commands(engines, packs, options, setup.deadline)]

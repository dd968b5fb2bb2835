"""The prefix-reuse benchmark against two live SGLang servers on one GPU (run by bench_live.sh).

NOT RUN YET: no machine of this project has had a GPU with SGLang 0.5.23 and the models on it.

    python benchmarks/bench_live.py SMALL LARGE --pack PACK_SMALL_TO_LARGE [--pack PACK_L_TO_S] \
        --workload workload.json --policy POLICY [--policy ...] [--out DIR] [--dry-run]

The trace (``sgl_kvmap.bench.workload.load_workload`` with the ``WorkloadConfig`` fields in
``--workload``, tokenized by SMALL's tokenizer: the pair shares it) is routed by every
``--policy`` (``routing.parse_policy``). Modes, re-prefill first (its answers are the quality
reference of the others):

- ``reprefill``: both servers with HiCache and SGLang's ``file`` store on one shared folder,
  no sgl-kvmap (``--hicache-storage-backend file``);
- ``translated``: the commands of ``sgl-kvmap sglang-args`` (KVMapStorage over the file store,
  the pair's packs, the prefetch deadline measured on this machine) with ``tail_pages`` 0;
- ``tail``: the same with sgl-kvmap's default tail.

For every (mode, policy) it starts both servers (one after the other, so each sees the other's
memory taken; ``--mem-fraction-static`` shares the GPU), waits for ``/health``, replays the
trace one request at a time (``sgl_kvmap.bench.live``), stops them and deletes the store: every
replay starts from empty caches, and nothing a KVMapStorage process remembers (which pages it
translated) leaks into the next replay. Writes ``records.jsonl`` (one ``RequestRecord`` a line,
appended as each replay ends), the servers' logs, and the report
(``sgl_kvmap.bench.report.write_report``) when that module is installed.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import sys
from datetime import date
from pathlib import Path

import click

from sgl_kvmap.bench.live import QUALITY_TOKENS
from sgl_kvmap.bench.records import MODES, REFERENCE_MODE, RequestRecord
from sgl_kvmap.bench.workload import WorkloadConfig
from sgl_kvmap.sglang.launch import PAGE_SIZE, EngineSpec, engine_commands, shell_line
from sgl_kvmap.sglang.servers import running_servers

log = logging.getLogger("bench_live")
EXTRA_CONFIG = "--hicache-storage-backend-extra-config"


def mode_commands(mode, engines, packs, store, deadline, mem_fractions) -> list[list[str]]:
    """Both servers' argv for one mode (module docstring), each with its memory share."""
    if mode == REFERENCE_MODE:
        commands = engine_commands(engines, [], store_path=store)
        commands = [_plain_file_store(argv, store) for argv in commands]
    else:
        commands = engine_commands(engines, packs, store_path=store, deadline=deadline)
        if mode == "translated":
            commands = [_with_extra(argv, tail_pages=0) for argv in commands]
    return [
        [*argv, "--mem-fraction-static", str(fraction)]
        for argv, fraction in zip(commands, mem_fractions)
    ]


def _plain_file_store(argv: list[str], store: str) -> list[str]:
    """SGLang's own file store in place of KVMapStorage (hicache_storage.py: HiCacheFile reads
    ``file_storage_path`` from the extra config)."""
    argv = _replace(argv, "--hicache-storage-backend", "file")
    return _replace(argv, EXTRA_CONFIG, json.dumps({"file_storage_path": store}))


def _with_extra(argv: list[str], **keys) -> list[str]:
    extra = json.loads(argv[argv.index(EXTRA_CONFIG) + 1])
    return _replace(argv, EXTRA_CONFIG, json.dumps({**extra, **keys}, sort_keys=True))


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def _write_report(records: list[RequestRecord], header: dict, out: Path) -> None:
    try:
        from sgl_kvmap.bench.report import write_report
    except ImportError:
        log.warning("sgl_kvmap.bench.report is not installed: records only (%s)", out)
        return
    write_report(records, header, out)


@click.command()
@click.argument("small")
@click.argument("large")
@click.option("--pack", "packs", multiple=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--workload",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="JSON object of sgl_kvmap.bench.workload.WorkloadConfig's fields.",
)
@click.option("--policy", "policy_texts", multiple=True, required=True)
@click.option(
    "--mode", "modes", multiple=True, type=click.Choice(MODES), default=MODES, show_default=True
)
@click.option("--seed", default=0, show_default=True)
@click.option("--quality-tokens", default=QUALITY_TOKENS, show_default=True)
@click.option("--port", default=30000, show_default=True, help="SMALL's port; LARGE's is +1.")
@click.option(
    "--mem-fraction-static",
    "mem_fractions",
    nargs=2,
    type=float,
    default=(0.3, 0.45),
    show_default=True,
    help="SMALL's and LARGE's share.",
)
@click.option("--store-path", default="/dev/shm/sgl-kvmap-bench", show_default=True)
@click.option("--out", default="benchmarks/results/bench_live", show_default=True)
@click.option("--dry-run", is_flag=True, help="Print the servers' commands per mode, start none.")
def main(small, large, packs, workload, policy_texts, modes, seed, quality_tokens, port,
         mem_fractions, store_path, out, dry_run) -> None:  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from sgl_kvmap.sglang.launch import PrefetchDeadline, measured_deadline

    modes = sorted(set(modes), key=MODES.index)  # re-prefill first: the reference
    if any(m != REFERENCE_MODE for m in modes) and not packs:
        raise click.UsageError("the translating modes need --pack (sgl-kvmap fit / resolve)")
    if modes[0] != REFERENCE_MODE:
        raise click.UsageError("quality needs the reprefill mode's answers: include it")
    engines = [EngineSpec(small, port=port), EngineSpec(large, port=port + 1)]
    deadline = PrefetchDeadline()
    if packs and not dry_run:
        deadline, lines = measured_deadline(list(packs))
        for line in lines:
            log.info(line)
    if dry_run:
        for mode in modes:
            commands = mode_commands(mode, engines, packs, store_path, deadline, mem_fractions)
            click.echo(f"# {mode}\n" + "\n".join(shell_line(c) for c in commands))
        return

    turns, ideal, routes = _workload(small, workload, policy_texts, seed)
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    jsonl = out / "records.jsonl"
    jsonl.write_text("")
    records, references = [], {}
    for mode in modes:
        for name, (models, moved) in routes.items():
            if mode != REFERENCE_MODE and not any(moved):
                continue  # nothing swapped: the translating modes serve it identically
            replayed = _replay_once(
                mode, name, engines, packs, store_path, deadline, mem_fractions, out,
                turns, models, moved, ideal, references.get(name), quality_tokens,
            )  # fmt: skip
            if mode == REFERENCE_MODE:
                references[name] = replayed.answers
            with jsonl.open("a") as f:
                f.writelines(json.dumps(r.to_json()) + "\n" for r in replayed.records)
            records.extend(replayed.records)
    config = WorkloadConfig(**json.loads(Path(workload).read_text()))
    header = {
        "command": shlex.join(sys.argv),
        "pair": f"small {small} <-> large {large}",
        "packs": ", ".join(packs),
        "trace": str(config.trace_path),
        "scale": f"1/{config.scale} (blocks of {config.block_tokens} tokens)",
        "requests": len(turns),
        "sessions": len({t.session for t in turns}),
        "page_size": PAGE_SIZE,
        "date": date.today().isoformat(),
        "machine": "live SGLang servers on one GPU, requests one at a time (no queueing)",
    }
    _write_report(records, header, out)
    log.info("%d records -> %s", len(records), jsonl)


def _workload(small, workload, policy_texts, seed):
    """The trace, each request's oracle reuse, and per policy (models, swapped) per request."""
    from transformers import AutoTokenizer

    from sgl_kvmap.bench.routing import parse_policy, swapped
    from sgl_kvmap.bench.workload import ideal_reuse, load_workload

    tokenizer = AutoTokenizer.from_pretrained(small)
    config = WorkloadConfig(**json.loads(Path(workload).read_text()))
    turns = load_workload(config, tokenizer)
    routes = {}
    for text in policy_texts:
        policy = parse_policy(text)
        models = policy.route(turns, seed=seed)
        routes[policy.name] = (models, swapped(turns, models))
    return turns, ideal_reuse(turns, PAGE_SIZE), routes


def _replay_once(mode, policy, engines, packs, store_path, deadline, mem_fractions, out, turns,
                 models, moved, ideal, references, quality_tokens):  # fmt: skip
    from sgl_kvmap.bench.live import LiveClient, replay

    store = f"{store_path}/{mode}-{policy}"
    shutil.rmtree(store, ignore_errors=True)
    Path(store).mkdir(parents=True)
    commands = mode_commands(mode, engines, packs, store, deadline, mem_fractions)
    # this interpreter, where sgl-kvmap is, runs each server
    lines = [shell_line([sys.executable, *argv[1:]]) for argv in commands]
    logs = [out / "logs" / f"{mode}-{policy}-{model}.log" for model in ("small", "large")]
    servers = {m: f"http://127.0.0.1:{e.port}" for m, e in zip(("small", "large"), engines)}
    log.info("mode %s, policy %s: %d requests", mode, policy, len(turns))
    for line, log_path in zip(lines, logs):
        log.info("starting %s (log %s)", line, log_path)
    try:
        with running_servers(lines, logs), LiveClient(servers) as client:
            return replay(
                turns, models, moved, ideal, policy=policy, mode=mode, client=client,
                references=references, quality_tokens=quality_tokens,
            )  # fmt: skip
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()

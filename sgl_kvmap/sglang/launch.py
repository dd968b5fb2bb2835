"""Launch flags for SGLang engines that share cached prefixes through sgl-kvmap (no sglang import).

Every engine gets HiCache with the KVMapStorage backend over one shared file store; its peers
are the other engines for which a pack translates INTO it. Packs are matched to engines by the
fingerprints recorded in them (config + tokenizer), never by name.

A translated prefetch must finish before SGLang's prefetch deadline (the ``timeout`` stop
policy: ``prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens / 1024`` seconds),
or SGLang cuts it and prefills the rest. ``prefetch_deadline`` sets both from the translation
KVMapStorage's work measured on this machine (``translation.hand_over_seconds``, as many swaps
at once as an engine translates), with a margin.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import KVMapError
from ..core.pack import read_config
from ..core.spec import spec_from_pretrained
from .settings import (
    INNER_BACKENDS,
    RETENTION_KEYS,
    PeerSettings,
    StorageSettings,
    prefetch_threshold_keys,
    served_key,
)

PREFETCH_POLICIES = ("timeout", "wait_complete", "best_effort")
DEVICES = ("cuda", "cpu")  # --device: SGLang's GPU engine, or its CPU engine
# What SGLang's CPU engine needs besides --device cpu: the variable that selects it (without it
# SGLang's rotary embedding imports vllm), torch-native attention (the x86 default, intel_amx,
# needs compiled sgl_kernel CPU ops), and this package's CPU stand-ins on PYTHONPATH
# (``cpu_engine``: an sgl_kernel of torch ops, no compiled build of which exists for CPUs, and
# SGLang 0.5.23's two CPU HiCache fixes) with a host-memory reserve a CPU machine can meet
# (SGLang keeps 10 GiB free beside the host pool; the stand-ins read this instead)
CPU_ENGINE_FOLDER = Path(__file__).with_name("cpu_engine")
CPU_HOST_RESERVE_BYTES = 1 << 30
CPU_ENVIRONMENT = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": str(CPU_ENGINE_FOLDER),
    "KVMAP_HICACHE_RESERVE_BYTES": str(CPU_HOST_RESERVE_BYTES),
}
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native")
STORE_PATH = "/tmp/sgl-kvmap-hicache"  # the file store's folder
MOONCAKE_METADATA_PORT = 8080  # the Mooncake master's HTTP metadata server, by default
STATS_FOLDER = "kvmap-stats"  # each engine's counters, in the store's folder
# Every engine's --page-size and --prefetch-threshold (tokens): small pages let a swap recompute
# a short tail (StorageSettings.tail_pages) and fetch a short run, which SGLang's own threshold
# (256 tokens) would prefill instead (docs/LOG.md, "the tail at 16-token pages")
PAGE_SIZE = 16
PREFETCH_THRESHOLD = PAGE_SIZE
MAX_PAGE_SIZE = 1024  # beyond it a page outgrows the prompts it would cache


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where its model is, the name it serves under (its identity in the store)."""

    model_path: str
    served_name: str = ""
    port: int = 30000
    tp_size: int = 1

    @property
    def name(self) -> str:
        return self.served_name or self.model_path


@dataclass(frozen=True)
class PrefetchDeadline:
    """SGLang's prefetch stop policy and, for ``timeout``, its deadline:
    ``base + per_ki_token x tokens / 1024`` seconds (SGLang's defaults: 1 and 0.25)."""

    policy: str = "timeout"
    base: float = 1.0
    per_ki_token: float = 0.25

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise KVMapError(f"prefetch policy must be one of {PREFETCH_POLICIES}")

    def seconds(self, tokens: int) -> float:
        return self.base + self.per_ki_token * tokens / 1024

    def sglang_keys(self) -> dict:
        """The extra-config keys SGLang reads for it."""
        return {
            "prefetch_timeout_base": self.base,
            "prefetch_timeout_per_ki_token": self.per_ki_token,
        }


def prefetch_deadline(
    measured: list[tuple[int, float]], margin: float = 3.0, policy: str = PrefetchDeadline.policy
) -> PrefetchDeadline:
    """A deadline ``margin`` times the translation time at every length, from (tokens,
    seconds) measured at two lengths (the time is linear in tokens); never below SGLang's
    defaults."""
    (n1, t1), (n2, t2) = sorted(measured)[0], sorted(measured)[-1]
    per_token = max(0.0, (t2 - t1) / (n2 - n1)) if n2 > n1 else t2 / n2
    fixed = max(0.0, t1 - per_token * n1)
    return PrefetchDeadline(
        policy,
        base=round(max(1.0, margin * fixed), 2),
        per_ki_token=round(max(0.25, margin * per_token * 1024), 3),
    )


@dataclass(frozen=True)
class LaunchOptions:
    """What the engines of one deployment share: the inner ``store`` and its folder
    (``store_path``), the page size, SGLang's engine (``device``: cuda, or its CPU engine),
    the KV pool's size in tokens (``max_total_tokens``; SGLang sizes it from free memory
    without one), and KVMapStorage's settings for engines that translate (``tail_pages``,
    ``concurrent_translations``, ``audit_translations``: ``StorageSettings``). Every engine
    keeps its counters in ``stats_path`` (a folder beside the store's pages). ``quality_floor``:
    the gap closed a pack must record for an engine to use it, ``retention_floor`` the
    retention of a pack with no gap to close (``StorageSettings``).
    ``prefetch_threshold``: the tokens a stored run needs before an engine fetches it (None:
    SGLang's own, 256; SGLang raises it to one page at least). ``sinks``: whether an engine
    may translate a prefix's first page (``StorageSettings.sinks``); ``first_layer``: whether
    it serves its own layer 0 for translated tokens (``StorageSettings.first_layer``);
    ``derived``: whether engines share the pages they compute over translated KV for their
    peers to translate (``StorageSettings.derived``)."""

    store: str = StorageSettings.inner_backend
    store_path: str = STORE_PATH
    page_size: int = PAGE_SIZE
    device: str = "cuda"
    max_total_tokens: int | None = None
    tail_pages: int = StorageSettings.tail_pages
    concurrent_translations: int = StorageSettings.concurrent_translations
    audit_translations: bool = False
    quality_floor: float | None = StorageSettings.quality_floor
    mooncake_master: str = ""
    mooncake_metadata: str = ""
    prefetch_threshold: int | None = PREFETCH_THRESHOLD
    sinks: str = StorageSettings.sinks
    first_layer: str = StorageSettings.first_layer
    derived: str = StorageSettings.derived
    retention_floor: float = StorageSettings.retention_floor

    def __post_init__(self) -> None:
        StorageSettings(  # their checks
            quality_floor=self.quality_floor,
            retention_floor=self.retention_floor,
            sinks=self.sinks,
            first_layer=self.first_layer,
            derived=self.derived,
        )
        if self.prefetch_threshold is not None and self.prefetch_threshold < 1:
            raise KVMapError(f"prefetch threshold {self.prefetch_threshold} < 1 token")
        if (self.store == "mooncake") != bool(self.mooncake_master):
            raise KVMapError(
                "--store mooncake and --mooncake-master HOST:PORT (the master's RPC address, "
                "reachable from every engine's host) go together"
            )
        if self.mooncake_master and not _host_port(self.mooncake_master):
            raise KVMapError(f"--mooncake-master must be HOST:PORT, got {self.mooncake_master!r}")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise KVMapError(f"page size must be 1 to {MAX_PAGE_SIZE} tokens, got {self.page_size}")
        if self.device not in DEVICES:
            raise KVMapError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.store not in INNER_BACKENDS:
            raise KVMapError(
                f"store {self.store!r} is not supported by sgl-kvmap (only "
                f"{', '.join(INNER_BACKENDS)})"
            )

    @property
    def stats_path(self) -> str:
        return str(Path(self.store_path) / STATS_FOLDER)

    @property
    def metadata_server(self) -> str:
        """The Mooncake HTTP metadata server's URL (by default the master's, on its host)."""
        host = self.mooncake_master.rpartition(":")[0]
        return self.mooncake_metadata or f"http://{host}:{MOONCAKE_METADATA_PORT}/metadata"

    def store_keys(self) -> dict | None:
        """SGLang's extra-config keys of the store, beyond the file store's folder (None: the
        file store). Each engine's own address comes from ``MOONCAKE_LOCAL_HOSTNAME`` on its
        host, which SGLang reads before the extra config."""
        if self.store != "mooncake":
            return None
        return {
            "master_server_address": self.mooncake_master,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
        }


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def mooncake_lines(options: LaunchOptions) -> list[str]:
    """What to run before the engines of a Mooncake deployment: the master with its HTTP
    metadata server, on the host ``--mooncake-master`` names, and the variable each engine's
    host sets (comment lines, then the master's command)."""
    port = options.mooncake_master.rpartition(":")[2]
    metadata_port = options.metadata_server.rsplit(":", 1)[1].split("/")[0]
    master = [
        "mooncake_master", f"--rpc_port={port}", "--enable_http_metadata_server=true",
        "--http_metadata_server_host=0.0.0.0", f"--http_metadata_server_port={metadata_port}",
    ]  # fmt: skip
    host = options.mooncake_master.rpartition(":")[0]
    return [
        f"# Mooncake master (on {host}), before the engines:",
        shell_line(master),
        "# on each engine's host: export MOONCAKE_LOCAL_HOSTNAME=<that host's address>, and "
        "every --model-path and pack below readable there",
    ]


def engine_commands(
    engines: list[EngineSpec],
    packs: list[str | Path],
    options: LaunchOptions = LaunchOptions(),
    deadline: PrefetchDeadline | None = None,
) -> list[list[str]]:
    """The command of every engine (same order), as shell words: ``python -m
    sglang.launch_server ...``, preceded by ``NAME=value`` environment assignments for SGLang's
    CPU engine (``options.device`` "cpu"), so ``shell_line`` prints a line a shell runs as it
    is. ``deadline``: the prefetch stop policy of engines that translate (SGLang's default
    without one)."""
    peers = peers_of(engines, packs)
    deadline = deadline or PrefetchDeadline()
    size = options.max_total_tokens
    sizing = ["--max-total-tokens", str(size)] if size else []
    env, flags = _device_words(options.device)
    return [
        [*env, *_command(e, peers[e.name], options, deadline), *flags, *sizing] for e in engines
    ]


def _device_words(device: str) -> tuple[list[str], list[str]]:
    """(environment assignments, flags) that select SGLang's engine for ``device``."""
    if device == "cpu":
        return [f"{name}={value}" for name, value in CPU_ENVIRONMENT.items()], list(CPU_FLAGS)
    return [], []


def engine_spec(text: str, port: int, tp_size: int = 1) -> EngineSpec:
    """The engine ``MODEL_PATH`` or ``MODEL_PATH=SERVED_NAME`` (a path that exists is taken
    whole, so it may hold "="; else the name follows the last "="). A local model path is made
    absolute, so the printed command runs from any folder."""
    path, name = text, ""
    if "=" in text and not Path(text).exists():
        path, name = text.rsplit("=", 1)
        if not path or not name:
            raise KVMapError(f"engine {text!r} is not MODEL_PATH or MODEL_PATH=SERVED_NAME")
    if Path(path).exists():
        path = str(Path(path).resolve())
    return EngineSpec(path, name, port=port, tp_size=tp_size)


def store_name(served_name: str) -> str:
    """The name SGLang's file and Mooncake stores key an engine's pages by: its served name
    with every "/" made "-" (``HiCacheFile``, ``MooncakeStore``'s prefix)."""
    return "-".join(served_name.split("/"))


def peers_of(engines: list[EngineSpec], packs: list[str | Path]) -> dict[str, list[PeerSettings]]:
    """Each engine's peers: the engines a pack translates from INTO it (by fingerprints).
    Refused: two engines under one served name or serving one model (a pack between them would
    hand one engine the other's KV as its own), a pack given twice, two packs for one
    direction."""
    by_fingerprint: dict[str, EngineSpec] = {}
    for engine in engines:
        fingerprint = spec_from_pretrained(engine.model_path).fingerprint
        twin = by_fingerprint.setdefault(fingerprint, engine)
        if twin is not engine:
            raise KVMapError(
                f"engines {twin.name!r} and {engine.name!r} serve the same model: sgl-kvmap "
                "shares prefixes between different models, one engine each"
            )
    names = [e.name for e in engines]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise KVMapError(f"served name {twice[0]!r} is given to two engines: names must differ")
    stored: dict[str, str] = {}  # the name SGLang's stores key each engine's pages by
    for name in names:
        other = stored.setdefault(store_name(name), name)
        if other != name:
            raise KVMapError(
                f"served names {other!r} and {name!r} are one name in the store "
                f"({store_name(name)!r}, as SGLang's stores spell it): names must differ"
            )
    peers: dict[str, list[PeerSettings]] = {e.name: [] for e in engines}
    directions: dict[tuple[str, str], Path] = {}
    for pack in packs:
        folder = Path(pack).resolve()
        config = read_config(folder)
        source = by_fingerprint.get(config["source_fingerprint"])
        target = by_fingerprint.get(config["target_fingerprint"])
        if source is None or target is None:
            raise KVMapError(
                f"pack {pack} maps {config['source']['model_id']} -> "
                f"{config['target']['model_id']}, which are not both among the engines"
            )
        earlier = directions.setdefault((source.name, target.name), folder)
        if earlier != folder:
            raise KVMapError(
                f"packs {earlier} and {folder} both map {source.name} -> {target.name}: "
                "give one pack per direction"
            )
        if any(peer.model_name == source.name for peer in peers[target.name]):
            raise KVMapError(f"pack {folder} is given twice")
        peers[target.name].append(
            PeerSettings(source.name, str(folder), source.model_path, source.tp_size)
        )
    return peers


def floor_lines(
    peers_by_engine: dict[str, list[PeerSettings]], options: LaunchOptions
) -> list[str]:
    """One line per pack (``peers_of``' peers of each engine): the figure the engines' quality
    floor reads of it (``StorageSettings.recorded_gap_closed``, or the retention of a pack with
    no gap to close), where it was measured, and whether the pack is used (a pack that is not
    leaves its swaps prefilled)."""
    settings = StorageSettings(
        tail_pages=options.tail_pages,
        quality_floor=options.quality_floor,
        retention_floor=options.retention_floor,
        sinks=options.sinks,
        first_layer=options.first_layer,
        derived=options.derived,
    )
    lines = []
    for target, peers in peers_by_engine.items():
        for peer in peers:
            metrics = read_config(Path(peer.pack)).get("metrics", {})
            key, value = settings.floor_figure(metrics, options.page_size)
            measured = f"records {key} {value:.3f}" if value is not None else f"records no {key}"
            if value is not None:
                measured += _where_measured(key, metrics, options)
            refusal = settings.floor_refusal(metrics, options.page_size)
            if options.quality_floor is None:
                verdict = "used (no quality floor)"
            elif refusal:
                verdict = f"NOT used, {target} prefills instead: {refusal}"
            elif key.endswith(RETENTION_KEYS):
                verdict = f"used: no gap to close, retention at least {options.retention_floor:g}"
            else:
                verdict = f"used: above the quality floor {options.quality_floor:g}"
            lines.append(f"pack {peer.model_name} -> {target} {measured}; {verdict}")
    return lines


def _where_measured(key: str, metrics: dict, options: LaunchOptions) -> str:
    """How the figure under ``key`` was measured, as a parenthesis for ``floor_lines``."""
    if key.startswith("served_"):
        swaps = metrics.get(served_key("swaps", tail=bool(options.tail_pages)))
        what = "the low end of its interval over" if "gap" in key else "over"
        return (
            f" ({what} {swaps} swaps served as these engines serve, `sgl-kvmap bench --record` "
            f"on {metrics.get('served_trace')})"
        )
    if key.endswith("_served"):
        return (
            f" (the library's hand-off as these engines serve it: {options.page_size}-token "
            f"pages, the first computed, a {options.tail_pages * options.page_size}-token tail)"
        )
    if options.tail_pages and type(metrics.get("eval_tail")) is int:
        return (
            f" (measured with a {metrics['eval_tail']}-token tail on the library's windows; "
            f"these engines recompute {options.tail_pages * options.page_size})"
        )
    return ""


def sglang_extra_config(
    settings: StorageSettings,
    store_path: str,
    deadline: PrefetchDeadline | None = None,
    store_keys: dict | None = None,
    prefetch_threshold: int | None = None,
) -> dict:
    """One engine's ``--hicache-storage-backend-extra-config`` object: its sgl-kvmap settings
    plus the SGLang keys they rely on (the prefix's page keys with every write, which is how a
    page's position reaches its record; the file store's folder, or ``store_keys``, SGLang's keys
    of another store such as Mooncake's ``master_server_address``; the prefetch deadline; the
    prefetch threshold, when not SGLang's own)."""
    where = store_keys if store_keys is not None else {"file_storage_path": store_path}
    keys = {
        "hicache_storage_pass_prefix_keys": True,
        **where,
        **prefetch_threshold_keys(prefetch_threshold),
    }
    return settings.to_extra_config(**keys, **(deadline.sglang_keys() if deadline else {}))


def _command(engine, peers, options: LaunchOptions, deadline) -> list[str]:
    settings = StorageSettings(
        inner_backend=options.store,
        translate=bool(peers),
        sinks=options.sinks,
        first_layer=options.first_layer,
        derived=options.derived,
        tail_pages=options.tail_pages,
        concurrent_translations=options.concurrent_translations,
        interface_v1=True,
        model_path=engine.model_path,
        stats_path=options.stats_path,
        audit_translations=options.audit_translations and bool(peers),
        quality_floor=options.quality_floor,
        retention_floor=options.retention_floor,
        peers=tuple(peers),
    )
    deadline = deadline if peers else None
    extra = sglang_extra_config(
        settings, options.store_path, deadline, options.store_keys(), options.prefetch_threshold
    )
    policy = ["--hicache-storage-prefetch-policy", deadline.policy] if deadline else []
    # one flag and its value a line, as on a command line
    return [
        "python", "-m", "sglang.launch_server",
        "--model-path", engine.model_path,
        "--served-model-name", engine.name,
        "--port", str(engine.port),
        "--tp-size", str(engine.tp_size),
        "--page-size", str(options.page_size),
        "--enable-cache-report",  # cached tokens in the OpenAI endpoints' usage
        "--sleep-on-idle",  # an idle scheduler waits on its sockets instead of spinning a core
        "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic",
        *policy,
        "--hicache-storage-backend-extra-config", json.dumps(extra, sort_keys=True),
    ]  # fmt: skip


def shell_line(argv: list[str]) -> str:
    """``argv`` (``engine_commands``' words) as one shell command line."""
    return " ".join(shlex.quote(arg) for arg in argv)


def measured_deadline(
    packs: list[str | Path],
    policy: str = PrefetchDeadline.policy,
    lengths: tuple[int, int] = (1024, 4096),
    concurrent: int = StorageSettings.concurrent_translations,
    device: str = "cuda",
    page_size: int = PAGE_SIZE,
) -> tuple[PrefetchDeadline, list[str]]:
    """The prefetch deadline for the slowest pack's translation, timed on this machine as an
    engine runs it (one torch thread; on the GPU when there is one) with ``concurrent`` swaps
    translated at once (an engine's ``concurrent_translations``: a swap may arrive while the
    others are translated, and must still land), and a line per pack saying what was
    measured. ``device``: the engines' (``LaunchOptions.device``); a cuda engine translates on
    its GPU when this machine has one; ``page_size``: the engines' tokens per page."""
    import torch

    from ..core.mapper import KVMapper
    from .translation import hand_over_seconds

    device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    deadlines, lines = [], []
    for pack in packs:
        mapper = KVMapper.from_pretrained(pack).to(device)
        times = [
            (n, hand_over_seconds(mapper, n, page_size, concurrent=concurrent)) for n in lengths
        ]
        deadlines.append(prefetch_deadline(times, policy=policy))
        measured = ", ".join(f"{n:,} tokens {t:.2f} s" for n, t in times)
        lines.append(
            f"hand-over by {pack} on this machine ({device}, 1 thread, {concurrent} swaps at "
            f"once): {measured}"
        )
    if not deadlines:
        return PrefetchDeadline(policy), lines
    slowest = max(deadlines, key=lambda d: d.seconds(8192))
    return slowest, lines

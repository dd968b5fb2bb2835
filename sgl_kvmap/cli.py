"""The ``sgl-kvmap`` command line: each command parses arguments and makes one library call."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from .fitting.config import (
    AUTO_K,
    FAMILY_RATES,
    OBJECTIVES,
    DemoConfig,
    EvalConfig,
    PackRecipe,
    TuneConfig,
)
from .models.transfer import Repair
from .sglang.launch import PAGE_SIZE, PREFETCH_POLICIES, STORE_PATH, EngineSpec, PrefetchDeadline
from .sglang.settings import INNER_BACKENDS, StorageSettings

# the defaults every option shows and falls back to (sgl_kvmap/fitting/config.py)
PACK, TUNE, EVAL, DEMO = PackRecipe(), TuneConfig(), EvalConfig(), DemoConfig()
SWEEPS_HELP = (
    "0: the source decodes its draft greedily, one token per forward; S: it guesses the draft "
    "by prompt lookup and refines it in S parallel forwards (Jacobi sweeps)."
)


def _rank_text(rank: int | str | None) -> str:
    """A rank as --rank spells it."""
    return "none" if rank is None else str(rank)


def _tune_steps(tuning: TuneConfig | None) -> int:
    """Tuning steps as --tune-steps spells them (0: no tuning)."""
    return 0 if tuning is None else tuning.steps


def _repair(anchors: int, draft: int, sweeps: int) -> Repair | None:
    """The repair --anchors/--draft/--sweeps ask for (0 anchors: none)."""
    return Repair(anchors, draft, sweeps) if anchors else None


def _repair_options(repair: Repair | None, anchors_help: str, draft_help: str):
    """--anchors, --draft and --sweeps, defaulting to ``repair`` (None: 0 anchors, no repair;
    the draft and sweeps ``Repair``'s own)."""
    repair = repair or Repair(anchors=0)
    options = [
        click.option("--anchors", default=repair.anchors, show_default=True, help=anchors_help),
        click.option("--draft", default=repair.draft, show_default=True, help=draft_help),
        click.option("--sweeps", default=repair.sweeps, show_default=True, help=SWEEPS_HELP),
    ]

    def decorate(command):
        for option in reversed(options):  # as if written top to bottom
            command = option(command)
        return command

    return decorate


def _rank(value: str | None) -> int | str | None:
    if value in (None, "none"):
        return None
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError as err:
        raise click.BadParameter(
            f"--rank takes 'auto', 'none' or an integer, got {value!r}"
        ) from err


def _rank_or_top_k(ctx: click.Context, rank: int | str | None) -> int | str | None:
    """The rank to fit: an explicit --top-k without an explicit --rank asks for a k-layer map."""
    explicit = {
        name
        for name in ("rank", "top_k")
        if ctx.get_parameter_source(name)
        not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    }
    if explicit == {"top_k"}:
        return None
    if explicit == {"rank", "top_k"} and rank is not None:
        raise click.UsageError("--top-k applies to k-layer maps: pass --rank none with it")
    return rank


def _lr_option(flag: str, tuning: TuneConfig):
    """Tuning's learning rate, for `tune --lr` and `fit --tune-lr`."""
    return click.option(
        flag,
        type=float,
        default=tuning.lr,
        help="Tuning's relative Adam learning rate (each weight tensor's step: this x its RMS). "
        "Default: "
        + ", ".join(f"{rate:g} for {name} maps" for name, rate in FAMILY_RATES.items())
        + ".",
    )


def _objective_option(flag: str, tuning: TuneConfig):
    """Tuning's loss, for `tune --objective` and `fit --tune-objective`."""
    return click.option(
        flag,
        type=click.Choice(OBJECTIVES),
        default=tuning.objective,
        show_default=True,
        help="Tuning's loss. nll: cross-entropy on the true next tokens; kl: KL divergence from "
        "the target's own next-token distribution (one more target forward per step).",
    )


def _top_k(value: str) -> int | str:
    if value in AUTO_K:
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("expected 'auto', 'auto-layer' or a positive integer") from None


def _pack_folder(pack: str) -> str:
    """A local pack folder for ``pack``: the folder itself, or a Hub pack fetched at one commit
    (REPO_ID or REPO_ID@REVISION)."""
    from .core.pack import is_repo_id
    from .registry.packs import fetch_pack

    repo_id, _, revision = pack.partition("@")
    if Path(pack).is_dir() or not is_repo_id(repo_id):
        if not Path(pack).is_dir():
            raise click.BadParameter(f"{pack} is neither a pack folder nor a Hub repo id")
        return pack
    return str(fetch_pack(repo_id, revision=revision or None))


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """Cross-model KV cache transfer: fit, evaluate and inspect mapper packs."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


@main.command()
@click.argument("source")
@click.argument("target")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Pack folder to write.",
)
@click.option(
    "--calibration",
    multiple=True,
    type=click.Path(exists=True),
    help="Text file or folder (repeatable). Default: Python stdlib sources.",
)
@click.option(
    "--tokens",
    default=PACK.calibration.tokens,
    show_default=True,
    help="Calibration tokens (train + held-out). The fidelity loop's strongest lever, and "
    "capture time grows with it (see docs/LOG.md).",
)
@click.option(
    "--window",
    default=PACK.calibration.window,
    show_default=True,
    help="Tokens per calibration forward.",
)
@click.option(
    "--top-k",
    "top_k",
    default=str(PACK.calibration.top_k),
    show_default=True,
    help="Source layers per target layer: N, 'auto' (one k, chosen on held-out calibration "
    "tokens) or 'auto-layer' (a k per target layer).",
)
@click.option(
    "--ridge",
    default=PACK.calibration.ridge,
    show_default=True,
    help="Ridge lambda on the un-normalised Gram.",
)
@click.option(
    "--ridge-relative",
    is_flag=True,
    help="Read --ridge as a multiple of the Gram's mean diagonal.",
)
@click.option(
    "--sink-tokens",
    default=PACK.calibration.sink_tokens,
    show_default=True,
    help="Leading tokens the target computes itself.",
)
@click.option(
    "--stride",
    default=PACK.calibration.stride,
    show_default=True,
    help="Keep every n-th calibration token.",
)
@click.option(
    "--attention-power",
    default=PACK.calibration.attention_power,
    show_default=True,
    help="Weight calibration tokens by the attention the target pays them, to this power "
    "(0: unweighted).",
)
@click.option(
    "--rank",
    default=_rank_text(PACK.calibration.rank),
    show_default=True,
    help="Reduced-rank map: every target layer reads all source layers through one shared "
    "projection of rank N, or 'auto' (the smallest rank within tolerance of the best held-out "
    "R2, unless the k-layer map is better; see docs/LOG.md). "
    "'none': a map from k selected source layers (--top-k). An explicit --top-k alone means "
    "'none'.",
)
@click.option(
    "--tune-steps",
    default=_tune_steps(PACK.tuning),
    show_default=True,
    help="Then tune the fitted map for this many steps on the target's next-token loss over "
    "translated caches (`sgl-kvmap tune`; 0: the closed-form fit as it is).",
)
@_lr_option("--tune-lr", PACK.tuning or TUNE)
@_objective_option("--tune-objective", PACK.tuning or TUNE)
@click.pass_context
def fit(
    ctx,
    source,
    target,
    out,
    calibration,
    tokens,
    window,
    top_k,
    ridge,
    ridge_relative,
    sink_tokens,
    stride,
    attention_power,
    rank,
    tune_steps,
    tune_lr,
    tune_objective,
) -> None:
    """Fit a SOURCE -> TARGET mapper (anything transformers loads) and save it as a pack."""
    from .fitting.build import build_pack

    calibration_config = replace(
        PACK.calibration,
        tokens=tokens,
        window=window,
        top_k=_top_k(top_k),
        ridge=ridge,
        ridge_relative=ridge_relative,
        sink_tokens=sink_tokens,
        stride=stride,
        attention_power=attention_power,
        rank=_rank_or_top_k(ctx, _rank(rank)),
    )
    tuning = (
        replace(PACK.tuning or TUNE, steps=tune_steps, lr=tune_lr, objective=tune_objective)
        if tune_steps
        else None
    )
    recipe = PackRecipe(calibration_config, tuning)
    mapper, summary = build_pack(source, target, list(calibration) or None, recipe)
    mapper.save_pretrained(out)
    click.echo(json.dumps(summary, indent=2))
    click.echo(f"pack written to {out}")


@main.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Pack folder to write the tuned mapper to.",
)
@click.option(
    "--calibration",
    multiple=True,
    type=click.Path(exists=True),
    help="Text file or folder (repeatable), split into training and held-out files as `fit` "
    "splits them. Default: the Python stdlib's sources and those of sgl-kvmap's dependencies.",
)
@click.option("--steps", default=TUNE.steps, show_default=True, help="Gradient steps.")
@_lr_option("--lr", TUNE)
@click.option(
    "--prompt-len",
    default=TUNE.prompt_len,
    show_default=True,
    help="Prompt tokens translated per step.",
)
@click.option(
    "--continuation",
    default=TUNE.continuation,
    show_default=True,
    help="Tokens after the prompt whose next-token loss is minimised.",
)
@click.option(
    "--eval-every",
    default=TUNE.eval_every,
    show_default=True,
    help="Score held-out windows every N steps; the best weights are kept.",
)
@_objective_option("--objective", TUNE)
@click.option(
    "--warmup",
    default=TUNE.warmup,
    show_default=True,
    help="Steps over which the rate rises linearly to --lr.",
)
@click.option(
    "--tail",
    default=TUNE.tail,
    show_default=True,
    help="Prompt tokens the hand-off recomputes (`eval --tail`); the map is tuned and scored "
    "for that hand-off.",
)
@click.option(
    "--residual-hidden",
    default=TUNE.residual_hidden,
    show_default=True,
    help="Grow a non-linear residual of this width on a reduced-rank map and tune it with the "
    "rest (0: the map stays affine).",
)
@click.option("--source", "source_path", default=None, help="Default: the pack's source.")
@click.option("--target", "target_path", default=None, help="Default: the pack's target.")
def tune(
    pack,
    out,
    calibration,
    steps,
    lr,
    prompt_len,
    continuation,
    eval_every,
    objective,
    warmup,
    tail,
    residual_hidden,
    source_path,
    target_path,
) -> None:
    """Tune a pack's map on the target's next-token loss over translated caches, save a pack.

    The map keeps its shapes (kernels and the SGLang extension serve it as they serve a fitted
    one), affine unless --residual-hidden grows a non-linear residual on it; held-out
    calibration windows score it every --eval-every steps and the best weights, the fitted ones
    included, are kept.
    """
    from .core.mapper import KVMapper
    from .fitting.tune import tune_mapper
    from .models.capture import load_model

    mapper = KVMapper.from_pretrained(pack)
    source = load_model(source_path or mapper.source.model_id)
    target = load_model(target_path or mapper.target.model_id)
    config = TuneConfig(
        steps=steps,
        lr=lr,
        prompt_len=prompt_len,
        continuation=continuation,
        eval_every=eval_every,
        objective=objective,
        warmup=warmup,
        tail=tail,
        residual_hidden=residual_hidden,
    )
    tuned, report = tune_mapper(mapper, source, target, list(calibration) or None, config)
    tuned.save_pretrained(out)
    click.echo(json.dumps({**report.summary(), "curve": report.curve}, indent=2))
    click.echo(f"pack written to {out}")


@main.command(name="eval")
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--texts",
    multiple=True,
    type=click.Path(exists=True),
    help="Held-out text file or folder (repeatable). Default: third-party sources + licence texts.",
)
@click.option("--prefix-len", default=EVAL.prefix_len, show_default=True)
@click.option("--continuation", default=EVAL.continuation, show_default=True)
@click.option(
    "--tail",
    default=EVAL.tail,
    show_default=True,
    help="Prompt tokens recomputed by the target besides the last one.",
)
@click.option(
    "--windows",
    default=EVAL.windows,
    show_default=True,
    help="Evaluation windows (one per text file).",
)
@click.option(
    "--source",
    "source_path",
    default=None,
    help="Source model (default: the path recorded in the pack).",
)
@click.option(
    "--target",
    "target_path",
    default=None,
    help="Target model (default: the path recorded in the pack).",
)
@_repair_options(
    EVAL.repair,
    anchors_help="Also score the hand-off repair: translated tokens the target recomputes, "
    "picked by the source's draft (0: off).",
    draft_help="Tokens the source drafts to pick them.",
)
@click.option(
    "--speed-tokens",
    default=EVAL.speed_tokens,
    show_default=True,
    help="Also time the same hand-off (tail, repair) against the target's re-prefill of a "
    "prompt of this many tokens, on this machine (0: off).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def eval_(
    pack,
    texts,
    prefix_len,
    continuation,
    tail,
    windows,
    source_path,
    target_path,
    anchors,
    draft,
    sweeps,
    speed_tokens,
    as_json,
) -> None:
    """Measure a pack's fidelity on held-out text, beside target, source and no-prefix baselines."""
    from .core.mapper import KVMapper
    from .fitting.evaluate import evaluate
    from .fitting.texts import default_eval_files, eval_windows, expand_paths, prompt_of_length
    from .models.capture import load_model
    from .models.timing import measure_speed

    config = EvalConfig(
        prefix_len, continuation, tail, windows, _repair(anchors, draft, sweeps), speed_tokens
    )
    mapper = KVMapper.from_pretrained(pack)
    source = load_model(source_path or mapper.source.model_id)
    target = load_model(target_path or mapper.target.model_id)
    files = expand_paths(texts) if texts else default_eval_files()
    token_windows = eval_windows(target.tokenizer, files, prefix_len + continuation, windows)
    report = evaluate(
        mapper,
        source,
        target,
        token_windows,
        prefix_len,
        continuation,
        tail,
        repair=config.repair,
    )
    speed = None
    if speed_tokens:
        prompt = prompt_of_length(target.tokenizer, speed_tokens)
        speed = measure_speed(mapper, source, target, prompt, tail=tail, repair=config.repair)
    if as_json:
        result = report.to_dict()
        if speed is not None:
            result["speed"] = speed.to_dict()
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(report.table() + ("" if speed is None else "\n" + speed.line()))


@main.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
def inspect(pack) -> None:
    """Validate a pack and print what it maps and what was measured."""
    from .core.mapper import KVMapper

    mapper = KVMapper.from_pretrained(pack)
    s, t = mapper.source, mapper.target
    click.echo(
        f"source  {s.model_id}  layers {s.num_layers}  kv {s.num_kv_heads}x{s.head_dim}  "
        f"fingerprint {s.fingerprint[:16]}"
    )
    click.echo(
        f"target  {t.model_id}  layers {t.num_layers}  kv {t.num_kv_heads}x{t.head_dim}  "
        f"fingerprint {t.fingerprint[:16]}"
    )
    k = mapper.source_layers_per_target
    click.echo(f"k {k}  ridge {mapper.ridge}  sink tokens {mapper.sink_tokens}")
    click.echo("calibration " + json.dumps(mapper.info.get("calibration", {}), sort_keys=True))
    for key, value in sorted(mapper.info.get("metrics", {}).items()):
        click.echo(
            f"  {key:<32} {value:.4f}" if isinstance(value, float) else f"  {key:<32} {value}"
        )


@main.command()
@click.option(
    "--tokens",
    default=DEMO.recipe.calibration.tokens,
    show_default=True,
    help="Calibration tokens (both directions share them).",
)
@click.option(
    "--windows",
    default=DEMO.evaluation.windows,
    show_default=True,
    help="Evaluation windows per direction.",
)
@click.option("--prefix-len", default=DEMO.evaluation.prefix_len, show_default=True)
@click.option("--continuation", default=DEMO.evaluation.continuation, show_default=True)
@click.option("--tail", default=DEMO.evaluation.tail, show_default=True)
@click.option(
    "--bench-tokens",
    default=DEMO.evaluation.speed_tokens,
    show_default=True,
    help="Prefix length for the speed comparison.",
)
@click.option(
    "--out",
    default="kvmap-demo",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the two packs and results.json.",
)
@_repair_options(
    DEMO.evaluation.repair,
    anchors_help="Translated tokens the repaired hand-off recomputes (0: no repair row).",
    draft_help="Source draft that picks them.",
)
@click.option(
    "--rank",
    default=_rank_text(DEMO.recipe.calibration.rank),
    show_default=True,
    help="Reduced rank of both maps: N, 'auto' or 'none' (k selected source layers).",
)
@click.option(
    "--tune-steps",
    default=_tune_steps(DEMO.recipe.tuning),
    show_default=True,
    help="Downstream tuning steps after each fit (`sgl-kvmap tune`; 0: none).",
)
def demo(
    tokens,
    windows,
    prefix_len,
    continuation,
    tail,
    bench_tokens,
    out,
    anchors,
    draft,
    sweeps,
    rank,
    tune_steps,
) -> None:
    """The whole job on the embedded Qwen2.5-Coder 0.5B/1.5B pair.

    Fetch and convert the pair once, fit both directions, evaluate, time, print one table.
    """
    from .demo import run_demo

    recipe = PackRecipe(
        replace(DEMO.recipe.calibration, tokens=tokens, rank=_rank(rank)),
        replace(DEMO.recipe.tuning or TUNE, steps=tune_steps) if tune_steps else None,
    )
    evaluation = EvalConfig(
        prefix_len, continuation, tail, windows, _repair(anchors, draft, sweeps), bench_tokens
    )
    click.echo(run_demo(out, DemoConfig(recipe, evaluation)))


@main.command(name="sglang-args")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    required=True,
    help="MODEL_PATH or MODEL_PATH=SERVED_NAME of one SGLang engine (repeat for each).",
)
@click.option(
    "--pack",
    "packs",
    multiple=True,
    callback=lambda ctx, param, packs: [_pack_folder(pack) for pack in packs],
    help="A mapper pack between two of the engines, a folder or a Hub repo id (fetched at one "
    "commit; repeat, one per direction).",
)
@click.option(
    "--store",
    type=click.Choice(INNER_BACKENDS),
    default=StorageSettings.inner_backend,
    show_default=True,
    help="Built-in HiCache store the engines share (file: one node; Mooncake and 3FS are not "
    "supported yet).",
)
@click.option("--store-path", default=STORE_PATH, show_default=True)
@click.option("--page-size", default=PAGE_SIZE, show_default=True)
@click.option(
    "--port", default=EngineSpec.port, show_default=True, help="First engine's port (+1 each)."
)
@click.option(
    "--tp", "tp_size", default=EngineSpec.tp_size, show_default=True, help="Tensor parallel size."
)
@click.option(
    "--prefetch-policy",
    type=click.Choice(PREFETCH_POLICIES),
    default=PrefetchDeadline.policy,
    show_default=True,
    help="SGLang's prefetch stop policy for engines that translate; with timeout, the deadline "
    "is set from the packs' translation time measured on this machine.",
)
def sglang_args(engines, packs, store, store_path, page_size, port, tp_size, prefetch_policy):
    """Print the SGLang launch command of every ENGINE, sharing prefixes through sgl-kvmap."""
    from .sglang.launch import engine_commands, measured_deadline, shell_line

    specs = [
        EngineSpec(*engine.split("=", 1), port=port + i, tp_size=tp_size)
        for i, engine in enumerate(engines)
    ]
    deadline, lines = measured_deadline(list(packs), prefetch_policy)
    for line in lines:
        click.echo(f"# {line}")
    if packs and deadline.policy == "timeout":
        click.echo(
            f"# prefetch deadline: {deadline.base:g} s + {deadline.per_ki_token:g} s per 1K "
            f"tokens ({deadline.seconds(2048):.1f} s at 2,048 tokens, "
            f"{deadline.seconds(8192):.1f} s at 8,192)"
        )
    commands = engine_commands(specs, list(packs), store, store_path, page_size, deadline)
    for spec, argv in zip(specs, commands):
        click.echo(f"# {spec.name}")
        click.echo(shell_line(argv))


# -- the registry: packs on the Hugging Face Hub -------------------------------------------


@main.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch to commit to (created if missing).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--tag", default=None, help="Tag the new commit (for example v1).")
def push(pack, repo_id, revision, private, tag) -> None:
    """Verify PACK and publish it to the Hub repo REPO_ID in one commit; print the commit."""
    from .registry.packs import push_pack

    commit = push_pack(pack, repo_id, revision=revision, private=private, tag=tag)
    click.echo(f"{repo_id}@{commit}")


@main.command()
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
def pull(repo_id, revision) -> None:
    """Fetch the pack REPO_ID into the Hugging Face cache, verify it, print its folder."""
    from .core.mapper import KVMapper
    from .registry.packs import fetch_pack

    folder = fetch_pack(repo_id, revision=revision)
    KVMapper.from_pretrained(folder)
    click.echo(str(folder))


@main.command()
@click.argument("source")
@click.argument("target")
@click.option("--build", is_flag=True, help="Fit the pair here when no pack is found.")
@click.option("--offline", is_flag=True, help="Look in the local caches only.")
@click.option(
    "--allow-mismatch",
    is_flag=True,
    help="Accept a pack fitted for other models than SOURCE and TARGET (logged).",
)
@click.option("--namespace", default=None, help="Hub namespace of conventionally named packs.")
def resolve(source, target, build, offline, allow_mismatch, namespace) -> None:
    """Find the pack for SOURCE -> TARGET (local cache, then Hub, then --build); print its
    folder."""
    from .registry.resolve import resolve_pack

    folder = resolve_pack(
        source,
        target,
        build=build,
        local_files_only=offline,
        allow_mismatch=allow_mismatch,
        namespace=namespace,
    )
    click.echo(str(folder))


@main.command(name="list")
@click.option("--remote", is_flag=True, help="List the packs on the Hub instead of the cache.")
def list_(remote) -> None:
    """List the packs in the local caches (or on the Hub)."""
    from .registry.packs import cached_packs, hub_packs
    from .registry.resolve import built_packs

    entries = hub_packs() if remote else built_packs() + cached_packs()
    for entry in entries:
        click.echo(
            f"{entry.repo_id}  {(entry.commit or '-')[:12]}  {entry.source} -> {entry.target}  "
            f"{entry.where}"
        )
    if not entries:
        click.echo("no packs " + ("on the Hub" if remote else "in the local caches"))


@main.command()
@click.argument("pack")
@click.option("--revision", default=None, help="For a Hub pack: branch, tag or commit.")
@click.option("--source", "source_model", default=None, help="Check the pack against this model.")
@click.option("--target", "target_model", default=None, help="Check the pack against this model.")
def verify(pack, revision, source_model, target_model) -> None:
    """Check a pack folder or Hub repo: integrity, format, and (given models) its pins."""
    from .core.mapper import KVMapper
    from .core.pack import is_repo_id, read_config
    from .core.spec import check_models, spec_from_pretrained
    from .registry.packs import fetch_pack

    remote = not Path(pack).exists() and is_repo_id(pack)
    folder = fetch_pack(pack, revision=revision) if remote else Path(pack)
    mapper = KVMapper.from_pretrained(folder)
    config = read_config(folder)
    click.echo(f"ok  {folder}")
    click.echo("ok  integrity: tensors checksum, manifest digest and schema, shapes")
    click.echo(
        f"ok  format version {config['format_version']} (library {config['library_version']})"
    )
    click.echo(f"ok  pair {mapper.source.model_id} -> {mapper.target.model_id}")
    click.echo(f"    source fingerprint {mapper.source.fingerprint}")
    click.echo(f"    target fingerprint {mapper.target.fingerprint}")
    if source_model or target_model:
        source = spec_from_pretrained(source_model) if source_model else mapper.source
        target = spec_from_pretrained(target_model) if target_model else mapper.target
        check_models(mapper, source, target)
        click.echo("ok  the given models are the ones the pack was fitted for")


if __name__ == "__main__":
    main()

"""The ``sgl-kvmap`` command line: each command parses arguments and makes one library call.

Bad input gets one clear line: click refuses a malformed or out-of-range option (exit 2, its
usage format), and an error the library raises on purpose (``KVMapError``) or meets in the
file system or on the network (``OSError``) is printed as ``error: <message>`` on stderr
(exit 1; ``--verbose`` adds the traceback). What a user typed is shown with its control
characters escaped, and a reader that closes stdout early (``| head``) ends the command quietly.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import shlex
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from .bench.records import MODES
from .bench.run import BenchConfig
from .bench.workload import MAX_CONTINUATION_TOKENS, OPENINGS, WorkloadConfig
from .core.errors import KVMapError
from .core.manifest import MAX_COUNT
from .fitting.config import (
    AUTO_K,
    CHECKPOINT_EVERY,
    FAMILY_RATES,
    OBJECTIVES,
    DemoConfig,
    EvalConfig,
    PackRecipe,
    TuneConfig,
)
from .models.transfer import ANCHOR_CHOICES, Repair
from .sglang.launch import (
    DEVICES,
    MAX_PAGE_SIZE,
    PAGE_SIZE,
    PREFETCH_POLICIES,
    PREFETCH_THRESHOLD,
    STORE_PATH,
    EngineSpec,
    LaunchOptions,
    PrefetchDeadline,
)
from .sglang.settings import (
    DERIVED_POLICIES,
    FIRST_LAYER_POLICIES,
    INNER_BACKENDS,
    MAX_CONCURRENT_TRANSLATIONS,
    SINK_POLICIES,
    StorageSettings,
)

# the defaults every option shows and falls back to (sgl_kvmap/fitting/config.py)
PACK, TUNE, EVAL, DEMO = PackRecipe(), TuneConfig(), EvalConfig(), DemoConfig()
WORKLOAD, BENCH = WorkloadConfig(), BenchConfig()
SWEEPS_HELP = (
    "0: the source decodes its draft greedily, one token per forward; S: it guesses the draft "
    "by prompt lookup and refines it in S parallel forwards (Jacobi sweeps)."
)


class LibraryError(click.ClickException):
    """An error of the library or the system, shown as one line ``error: <message>``."""

    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


class OneLineErrors(click.Group):
    """A group whose commands report a KVMapError or OSError as a LibraryError (one line,
    exit 1); with the group's ``--verbose`` the traceback is printed above it."""

    def make_context(self, info_name, args, parent=None, **extra):
        """Keep the arguments as given (``ctx.meta["argv"]``), for the card's command line."""
        given = list(args)
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta.setdefault("argv", given)
        return ctx

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        finally:  # what is still buffered for a reader that left shows here, not at exit
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                _reader_gone()

    def invoke(self, ctx: click.Context):
        argv = ctx.meta.get("argv", [])
        try:
            return super().invoke(ctx)
        except click.ClickException as err:  # a usage error, raised as a subcommand parses
            err.message = _one_line(err.message, argv)
            raise
        except (KVMapError, OSError) as err:
            if isinstance(err, BrokenPipeError) and _stdout_gone():
                _reader_gone()
            if ctx.params.get("verbose"):
                click.echo("".join(traceback.format_exception(err)), err=True, nl=False)
            raise LibraryError(_one_line(err, argv)) from err


def _one_line(err: BaseException | str, argv: list[str] = ()) -> str:
    """``err``'s message on one line (its type's name when it has none), every control
    character escaped: the arguments in ``argv`` (what the user typed: model ids, paths) as
    typed, the message's own line breaks as spaces."""
    text = str(err)
    for arg in argv:
        if not arg.isprintable():
            text = text.replace(arg, _escaped(arg))
    return _escaped(" ".join(text.split())) or type(err).__name__


def _escaped(text: str) -> str:
    """``text`` with each unprintable character as Python escapes it (``\\x1b``, ``\\n``)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's stream)
        return False


def _reader_gone():
    """Stop quietly: stdout's reader has left (``sgl-kvmap list | head -1``). Python's docs
    ("Note on SIGPIPE"): point stdout at devnull, so the interpreter's last flush cannot fail
    again, and exit 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(1)


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (FloatRange lets nan through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


class RankType(click.ParamType):
    """--rank: 'auto', 'none' (None: a k-layer map) or a positive integer."""

    name = "rank"

    def convert(self, value, param, ctx) -> int | str | None:
        if value in (None, "none", "auto"):
            return None if value == "none" else value
        try:
            rank = int(value)
        except ValueError:
            rank = 0
        if rank < 1:
            self.fail(f"takes 'auto', 'none' or an integer >= 1, got {value!r}", param, ctx)
        return rank


class TopKType(click.ParamType):
    """--top-k: 'auto', 'auto-layer' or a positive integer."""

    name = "top_k"

    def convert(self, value, param, ctx) -> int | str:
        if value in AUTO_K:
            return value
        try:
            k = int(value)
        except ValueError:
            k = 0
        if k < 1:
            self.fail(
                f"expected 'auto', 'auto-layer' or a positive integer, got {value!r}", param, ctx
            )
        return k


class FloorType(click.ParamType):
    """--quality-floor: a gap closed from -1 to 1, or 'none' (None: no floor)."""

    name = "floor"

    def convert(self, value, param, ctx) -> float | None:
        if value is None or value == "none" or isinstance(value, float):
            return None if value == "none" else value
        try:
            floor = float(value)
        except ValueError:
            floor = math.nan
        if not (math.isfinite(floor) and -1 <= floor <= 1):
            self.fail(f"takes a number from -1 to 1 or 'none', got {value!r}", param, ctx)
        return floor


class MaxMemoryType(click.ParamType):
    """--max-memory: DEVICE=SIZE (gpu or cpu; 70GiB, 512MB, bytes) as (device, bytes)."""

    name = "device=size"

    def convert(self, value, param, ctx) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        from .models.placement import parse_max_memory

        try:
            return parse_max_memory(value)
        except KVMapError as err:
            self.fail(str(err), param, ctx)


DTYPES = ("bfloat16", "float16", "float32")  # torch's names
COUNT = click.IntRange(min=1)  # at least one
AMOUNT = click.IntRange(min=0)  # 0: none / off
PROMPT = click.IntRange(min=2)  # a prompt: at least two tokens (the last one is recomputed)
PORT = click.IntRange(1, 65535)
MAX_OPENING_BYTES = 16 << 20  # an opening file larger than this is not a prompt prefix


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A number option that must be finite (click's FloatRange lets nan through)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def _off_or_prompt(ctx: click.Context, param: click.Parameter, tokens: int) -> int:
    """--speed-tokens: 0 (off) or a prompt of at least two tokens."""
    if tokens == 1:
        raise click.BadParameter("takes 0 (off) or a prompt of at least 2 tokens, got 1")
    return tokens


def _check_speed_tokens(ctx: click.Context, tokens: int, target) -> None:
    """Refuse a --speed-tokens prompt longer than the target model reads (``target``: its
    ModelSpec), before any model loads."""
    limit = target.config.get("max_position_embeddings")
    if limit and tokens > limit:
        raise click.BadParameter(
            f"a prompt of {tokens:,} tokens is longer than the target model reads ({limit:,} "
            "positions)",
            ctx,
            param_hint="'--speed-tokens'",
        )


def _check_tail(ctx: click.Context, tail: int, prompt_len: int, prompt_flag: str) -> None:
    """Refuse a --tail that does not leave the prompt's last token and one translated one."""
    if tail >= prompt_len - 1:
        raise click.BadParameter(
            f"must be less than {prompt_flag} - 1 ({prompt_len - 1}), got {tail}",
            ctx,
            param_hint="'--tail'",
        )


def _config(ctx: click.Context, make, *args, **kwargs):
    """``make(*args, **kwargs)`` (a config dataclass); what its validation refuses is a usage
    error (exit 2)."""
    try:
        return make(*args, **kwargs)
    except KVMapError as err:
        raise click.UsageError(str(err), ctx) from None


def _rank_text(rank: int | str | None) -> str:
    """A rank as --rank spells it."""
    return "none" if rank is None else str(rank)


def placement_options(command):
    """`--device-map`, `--max-memory` and `--offload-folder`: how a fit loads each model."""
    command = click.option(
        "--offload-folder",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="With --device-map: where weights that fit nowhere are written when they cannot be "
        "read from the model's own safetensors (a folder per process and model inside).",
    )(command)
    command = click.option(
        "--max-memory",
        type=MaxMemoryType(),
        multiple=True,
        help="With --device-map: memory each model may use on each GPU of a process (gpu=SIZE) "
        "or on the CPU (cpu=SIZE); repeat for both. Default: what is free.",
    )(command)
    return click.option(
        "--device-map",
        type=click.Choice(["auto"]),
        default=None,
        help="Load each model across this process's devices with accelerate (its GPUs, then the "
        "CPU, then disk) when one device cannot hold it; the captured K/V are the same.",
    )(command)


def _tune_steps(tuning: TuneConfig | None) -> int:
    """Tuning steps as --tune-steps spells them (0: no tuning)."""
    return 0 if tuning is None else tuning.steps


def _repair(anchors: int, draft: int, sweeps: int, choice: str = "draft") -> Repair | None:
    """The repair --anchors/--draft/--sweeps (and --anchor-choice) ask for (0 anchors: none)."""
    return Repair(anchors, draft, sweeps, choice) if anchors else None


def _repair_options(repair: Repair | None, anchors_help: str, draft_help: str):
    """--anchors, --draft and --sweeps, defaulting to ``repair`` (None: 0 anchors, no repair;
    the draft and sweeps ``Repair``'s own)."""
    repair = repair or Repair(anchors=0)
    options = [
        click.option(
            "--anchors", type=AMOUNT, default=repair.anchors, show_default=True, help=anchors_help
        ),
        click.option(
            "--draft", type=COUNT, default=repair.draft, show_default=True, help=draft_help
        ),
        click.option(
            "--sweeps", type=AMOUNT, default=repair.sweeps, show_default=True, help=SWEEPS_HELP
        ),
    ]

    def decorate(command):
        for option in reversed(options):  # as if written top to bottom
            command = option(command)
        return command

    return decorate


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
        type=FiniteFloatRange(min=0, min_open=True),
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


def _command_line() -> str:
    """The command line this run was given (as click parsed it, whatever the process's own
    ``sys.argv``), recorded beside the figures it measured (a pack's card, a bench run)."""
    return shlex.join(["sgl-kvmap", *click.get_current_context().meta["argv"]])


def _pack_folder(pack: str) -> str:
    """A local pack folder for ``pack``: the folder itself, or a Hub pack fetched at one commit
    (REPO_ID or REPO_ID@REVISION)."""
    from .core.pack import is_repo_id
    from .registry.packs import fetch_pack

    repo_id, _, revision = pack.partition("@")
    if Path(pack).is_dir():
        return pack
    if not is_repo_id(repo_id):
        raise click.BadParameter(f"{pack} is neither a pack folder nor a Hub repo id")
    return str(fetch_pack(repo_id, revision=revision or None))


@click.group(cls=OneLineErrors)
@click.option(
    "-v", "--verbose", is_flag=True, help="Log progress details; show the traceback of errors."
)
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
    help="Pack folder to write (new, empty, or a pack to replace with --overwrite).",
)
@click.option("--overwrite", is_flag=True, help="Replace the pack already at --out.")
@click.option(
    "--calibration",
    multiple=True,
    type=click.Path(exists=True),
    help="Text file or folder (repeatable). Default: Python stdlib sources.",
)
@click.option(
    "--tokens",
    type=COUNT,
    default=PACK.calibration.tokens,
    show_default=True,
    help="Calibration tokens (train + held-out). The fidelity loop's strongest lever, and "
    "capture time grows with it (see docs/LOG.md).",
)
@click.option(
    "--window",
    type=PROMPT,
    default=PACK.calibration.window,
    show_default=True,
    help="Tokens per calibration forward.",
)
@click.option(
    "--top-k",
    "top_k",
    type=TopKType(),
    default=str(PACK.calibration.top_k),
    show_default=True,
    help="Source layers per target layer: N, 'auto' (one k, chosen on held-out calibration "
    "tokens) or 'auto-layer' (a k per target layer).",
)
@click.option(
    "--ridge",
    type=FiniteFloatRange(min=0),
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
    type=click.IntRange(0, MAX_COUNT),
    default=PACK.calibration.sink_tokens,
    show_default=True,
    help="Leading tokens the target computes itself.",
)
@click.option(
    "--stride",
    type=COUNT,
    default=PACK.calibration.stride,
    show_default=True,
    help="Keep every n-th calibration token.",
)
@click.option(
    "--attention-power",
    type=FiniteFloatRange(min=0),
    default=PACK.calibration.attention_power,
    show_default=True,
    help="Weight calibration tokens by the attention the target pays them, to this power "
    "(0: unweighted).",
)
@click.option(
    "--rank",
    type=RankType(),
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
    type=AMOUNT,
    default=_tune_steps(PACK.tuning),
    show_default=True,
    help="Then tune the fitted map for this many steps on the target's next-token loss over "
    "translated caches (`sgl-kvmap tune`; 0: the closed-form fit as it is).",
)
@_lr_option("--tune-lr", PACK.tuning or TUNE)
@_objective_option("--tune-objective", PACK.tuning or TUNE)
@click.option(
    "--nproc",
    type=COUNT,
    default=None,
    help="Capture the statistics in this many processes (torchrun, one device each). "
    "Default: one per visible GPU, or the ranks torchrun started.",
)
@click.option(
    "--checkpoints",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder where each process saves its running statistics; a rerun of the same fit "
    "resumes from them instead of capturing again.",
)
@click.option(
    "--checkpoint-every",
    type=COUNT,
    default=CHECKPOINT_EVERY,
    show_default=True,
    help="Windows a process captures between two saves of its statistics.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="float32",
    show_default=True,
    help="Precision the models load and run in for the capture (the statistics are summed in "
    "float64 whatever it is).",
)
@placement_options
@click.pass_context
def fit(
    ctx,
    source,
    target,
    out,
    overwrite,
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
    nproc,
    checkpoints,
    checkpoint_every,
    dtype,
    device_map,
    max_memory,
    offload_folder,
) -> None:
    """Fit a SOURCE -> TARGET mapper (a local folder or a Hugging Face Hub id) and save it as a
    pack. Under torchrun (or with --nproc N) the calibration windows split across processes
    and rank 0 writes the one pack."""
    from .core.pack import check_destination
    from .fitting.build import build_pack
    from .fitting.distributed import describe_devices, fit_resumable, load_pair, ranks_from_env
    from .fitting.texts import check_model_tokenizers
    from .models.placement import Loading

    calibration_config = _config(
        ctx,
        replace,
        PACK.calibration,
        tokens=tokens,
        window=window,
        top_k=top_k,
        ridge=ridge,
        ridge_relative=ridge_relative,
        sink_tokens=sink_tokens,
        stride=stride,
        attention_power=attention_power,
        rank=_rank_or_top_k(ctx, rank),
    )
    tuning = (
        _config(
            ctx,
            replace,
            PACK.tuning or TUNE,
            steps=tune_steps,
            lr=tune_lr,
            objective=tune_objective,
        )
        if tune_steps
        else None
    )
    recipe = PackRecipe(calibration_config, tuning)
    check_destination(out, overwrite)  # before the fit's minutes, not after
    check_model_tokenizers(source, target)  # before any weight loads
    loading = _loading(ctx, dtype, device_map, max_memory, offload_folder)
    ranks = ranks_from_env()
    processes = nproc or default_nproc(sharded=device_map is not None)
    if ranks is None and processes > 1:
        _relaunch_under_torchrun(ctx, processes)
    command = _command_line()

    def save(mapper, summary) -> None:
        mapper.info["metrics"]["command"] = command
        mapper.save_pretrained(out, overwrite=overwrite)
        click.echo(json.dumps(summary, indent=2))
        click.echo(f"pack written to {out}")

    plain = ranks is None and checkpoints is None and loading == Loading()
    if not plain and (ranks is None or ranks.is_main):
        click.echo(describe_devices(ranks, loading), err=True)
    calibration = list(calibration) or None
    if plain:
        save(*build_pack(source, target, calibration, recipe))
        return
    if ranks is None and checkpoints is None:
        save(*build_pack(*load_pair(source, target, loading), calibration, recipe))
        return
    fit_resumable(
        source, target, calibration, recipe, ranks, save, checkpoints, checkpoint_every, loading
    )


def default_nproc(sharded: bool = False) -> int:
    """Processes a fit uses unless told: one per visible GPU (1 without GPUs), or 1 when each
    model loads sharded across them."""
    import torch

    return 1 if sharded else max(1, torch.cuda.device_count())


def _loading(ctx: click.Context, dtype: str, device_map, max_memory, offload_folder):
    """How fit loads its models: ``dtype`` and ``_placement``."""
    import torch

    from .models.placement import Loading

    placement = _placement(ctx, device_map, max_memory, offload_folder)
    return Loading(getattr(torch, dtype), placement)


def _placement(ctx: click.Context, device_map, max_memory, offload_folder):
    """The placement ``placement_options`` ask for (None: each model whole); the placement
    options only with --device-map."""
    from .models.placement import Placement

    if device_map is None and (max_memory or offload_folder is not None):
        ctx.fail("--max-memory and --offload-folder take effect only with --device-map auto")
    if device_map is None:
        return None
    return Placement(tuple(max_memory), offload_folder)


def _relaunch_under_torchrun(ctx: click.Context, nproc: int) -> None:
    """Run this command again under torchrun with ``nproc`` processes, and exit with its
    status (the arguments as given, less --nproc)."""
    import subprocess

    argv = _without_option(ctx.meta.get("argv", []), "--nproc")
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    launcher += ["-m", "sgl_kvmap", *argv]
    ctx.exit(subprocess.run(launcher).returncode)


def _without_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


@main.command()
@click.argument("pack", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Pack folder to write the tuned mapper to (new, empty, or a pack to replace with "
    "--overwrite).",
)
@click.option("--overwrite", is_flag=True, help="Replace the pack already at --out.")
@click.option(
    "--calibration",
    multiple=True,
    type=click.Path(exists=True),
    help="Text file or folder (repeatable), split into training and held-out files as `fit` "
    "splits them. Default: the Python stdlib's sources and those of sgl-kvmap's dependencies.",
)
@click.option("--steps", type=COUNT, default=TUNE.steps, show_default=True, help="Gradient steps.")
@_lr_option("--lr", TUNE)
@click.option(
    "--prompt-len",
    type=PROMPT,
    default=TUNE.prompt_len,
    show_default=True,
    help="Prompt tokens translated per step.",
)
@click.option(
    "--continuation",
    type=COUNT,
    default=TUNE.continuation,
    show_default=True,
    help="Tokens after the prompt whose next-token loss is minimised.",
)
@click.option(
    "--eval-every",
    type=COUNT,
    default=TUNE.eval_every,
    show_default=True,
    help="Score held-out windows every N steps; the best weights are kept.",
)
@_objective_option("--objective", TUNE)
@click.option(
    "--warmup",
    type=AMOUNT,
    default=TUNE.warmup,
    show_default=True,
    help="Steps over which the rate rises linearly to --lr.",
)
@click.option(
    "--tail",
    type=AMOUNT,
    default=TUNE.tail,
    show_default=True,
    help="Prompt tokens the hand-off recomputes (`eval --tail`); the map is tuned and scored "
    "for that hand-off.",
)
@click.option(
    "--residual-hidden",
    type=AMOUNT,
    default=TUNE.residual_hidden,
    show_default=True,
    help="Grow a non-linear residual of this width on a reduced-rank map and tune it with the "
    "rest (0: the map stays affine).",
)
@click.option("--source", "source_path", default=None, help="Default: the pack's source.")
@click.option("--target", "target_path", default=None, help="Default: the pack's target.")
@click.pass_context
def tune(
    ctx,
    pack,
    out,
    overwrite,
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
    from .core.pack import check_destination
    from .fitting.texts import check_model_tokenizers
    from .fitting.tune import tune_mapper
    from .models.capture import load_models_for

    _check_tail(ctx, tail, prompt_len, "--prompt-len")
    config = _config(
        ctx,
        TuneConfig,
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
    check_destination(out, overwrite)  # before the models load and tuning runs
    mapper = KVMapper.from_pretrained(pack)
    check_model_tokenizers(
        source_path or mapper.source.model_id, target_path or mapper.target.model_id
    )
    source, target = load_models_for(mapper, source_path, target_path)
    tuned, report = tune_mapper(mapper, source, target, list(calibration) or None, config)
    tuned.info["metrics"]["command"] = _command_line()
    tuned.save_pretrained(out, overwrite=overwrite)
    click.echo(json.dumps({**report.summary(), "curve": report.curve}, indent=2))
    click.echo(f"pack written to {out}")


@main.command(name="eval")
@click.argument("pack", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--texts",
    multiple=True,
    type=click.Path(exists=True),
    help="Held-out text file or folder (repeatable). Default: third-party sources + licence texts.",
)
@click.option("--prefix-len", type=PROMPT, default=EVAL.prefix_len, show_default=True)
@click.option("--continuation", type=COUNT, default=EVAL.continuation, show_default=True)
@click.option(
    "--tail",
    type=AMOUNT,
    default=EVAL.tail,
    show_default=True,
    help="Prompt tokens recomputed by the target besides the last one.",
)
@click.option(
    "--windows",
    type=COUNT,
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
    "picked as --anchor-choice says (0: off).",
    draft_help="Tokens the source drafts to pick them (--anchor-choice draft).",
)
@click.option(
    "--anchor-choice",
    type=click.Choice(ANCHOR_CHOICES),
    default="draft",
    show_default=True,
    help="What picks the anchors: the source's draft; the source's attention from its last "
    "tail + 1 prompt tokens (what a source engine computes in its prefill); the target's "
    "attention from its own tail over the translated cache (a target pass over the tail first); "
    "or the tokens just before the tail (a longer tail).",
)
@click.option(
    "--speed-tokens",
    type=AMOUNT,
    callback=_off_or_prompt,
    default=EVAL.speed_tokens,
    show_default=True,
    help="Also time the same hand-off (tail, repair) against the target's re-prefill of a "
    "prompt of this many tokens, on this machine (0: off).",
)
@click.option(
    "--page-size",
    "served_page_size",
    type=COUNT,
    default=EVAL.served_page_size,
    show_default=True,
    help="The engines' --page-size: the hand-off as served computes its first page and "
    "translates whole pages.",
)
@click.option(
    "--tail-pages",
    "served_tail_pages",
    type=click.IntRange(min=0),
    default=EVAL.served_tail_pages,
    show_default=True,
    help="The engines' --tail-pages: the last pages the hand-off as served computes.",
)
@click.option(
    "--record",
    is_flag=True,
    help="Also write the measured figures into PACK's metrics (retention and gap closed per "
    "condition), which engines check against their --quality-floor.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def eval_(
    ctx,
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
    anchor_choice,
    speed_tokens,
    served_page_size,
    served_tail_pages,
    record,
    as_json,
) -> None:
    """Measure a pack's fidelity on held-out text, beside target, source and no-prefix baselines."""
    from .core.mapper import KVMapper
    from .fitting.evaluate import evaluate
    from .fitting.texts import (
        check_model_tokenizers,
        default_eval_files,
        eval_windows,
        expand_paths,
        prompt_of_length,
    )
    from .models.capture import load_models_for
    from .models.timing import measure_speed

    _check_tail(ctx, tail, prefix_len, "--prefix-len")
    if speed_tokens and anchors and anchor_choice != "draft":
        raise click.BadParameter(
            "the timing covers anchors picked by the draft only", ctx, param_hint="'--speed-tokens'"
        )
    repair = _config(ctx, _repair, anchors, draft, sweeps, anchor_choice)
    config = _config(
        ctx, EvalConfig, prefix_len, continuation, tail, windows, repair, speed_tokens,
        served_page_size, served_tail_pages,
    )  # fmt: skip
    if record and Path(pack).parent.name == "snapshots":
        raise click.BadParameter(
            f"{pack} is a download in the Hugging Face cache; copy it (cp -rL) and "
            "record into the copy",
            ctx,
            param_hint="'--record'",
        )
    mapper = KVMapper.from_pretrained(pack)
    _check_speed_tokens(ctx, speed_tokens, mapper.target)
    check_model_tokenizers(
        source_path or mapper.source.model_id, target_path or mapper.target.model_id
    )
    source, target = load_models_for(mapper, source_path, target_path)
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
        served=(config.served_page_size, config.served_tail_pages),
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
    if record:
        mapper.info.setdefault("metrics", {}).update(report.summary())
        mapper.info["metrics"]["eval_command"] = _command_line()
        click.echo(f"recorded in {mapper.save_pretrained(pack, overwrite=True)}", err=True)


@main.command()
@click.argument("pack", type=click.Path(file_okay=False, path_type=Path))
def inspect(pack) -> None:
    """Validate a pack and print what it maps, how it was made and what was measured."""
    from .core.mapper import KVMapper
    from .registry.resolve import pack_recipe

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
    click.echo(f"recipe {pack_recipe(pack)}")
    click.echo("calibration " + json.dumps(mapper.info.get("calibration", {}), sort_keys=True))
    for key, value in sorted(mapper.info.get("metrics", {}).items()):
        click.echo(
            f"  {key:<32} {value:.4f}" if isinstance(value, float) else f"  {key:<32} {value}"
        )


@main.command()
@click.option(
    "--tokens",
    type=COUNT,
    default=DEMO.recipe.calibration.tokens,
    show_default=True,
    help="Calibration tokens (both directions share them).",
)
@click.option(
    "--windows",
    type=COUNT,
    default=DEMO.evaluation.windows,
    show_default=True,
    help="Evaluation windows per direction.",
)
@click.option("--prefix-len", type=PROMPT, default=DEMO.evaluation.prefix_len, show_default=True)
@click.option("--continuation", type=COUNT, default=DEMO.evaluation.continuation, show_default=True)
@click.option("--tail", type=AMOUNT, default=DEMO.evaluation.tail, show_default=True)
@click.option(
    "--bench-tokens",
    type=PROMPT,
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
    type=RankType(),
    default=_rank_text(DEMO.recipe.calibration.rank),
    show_default=True,
    help="Reduced rank of both maps: N, 'auto' or 'none' (k selected source layers).",
)
@click.option(
    "--tune-steps",
    type=AMOUNT,
    default=_tune_steps(DEMO.recipe.tuning),
    show_default=True,
    help="Downstream tuning steps after each fit (`sgl-kvmap tune`; 0: none).",
)
@click.pass_context
def demo(
    ctx,
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

    _check_tail(ctx, tail, prefix_len, "--prefix-len")
    recipe = PackRecipe(
        _config(ctx, replace, DEMO.recipe.calibration, tokens=tokens, rank=rank),
        _config(ctx, replace, DEMO.recipe.tuning or TUNE, steps=tune_steps) if tune_steps else None,
    )
    repair = _config(ctx, _repair, anchors, draft, sweeps)
    evaluation = _config(
        ctx, EvalConfig, prefix_len, continuation, tail, windows, repair, bench_tokens
    )
    click.echo(run_demo(out, DemoConfig(recipe, evaluation)))


@main.command()
@click.option("--small", help="The small model (folder or Hub id). Default: the embedded 0.5B.")
@click.option("--large", help="The large model (folder or Hub id). Default: the embedded 1.5B.")
@click.option(
    "--pack-up",
    help="Pack small -> large (folder or REPO_ID[@REV]). Default: the registry's, else built.",
)
@click.option("--pack-down", help="Pack large -> small, likewise.")
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False),
    help="Mooncake-style JSONL (hash_ids) or SGLang's agentic-trace JSON. Default: the bundled "
    "Mooncake conversation trace.",
)
@click.option(
    "--scale",
    type=COUNT,
    default=WORKLOAD.scale,
    show_default=True,
    help="Divide the trace's 512-token blocks and every length by this (for a CPU).",
)
@click.option("--sessions", type=COUNT, default=WORKLOAD.sessions, show_default=True)
@click.option("--min-turns", type=COUNT, default=WORKLOAD.min_turns, show_default=True)
@click.option("--max-turns", type=COUNT, default=WORKLOAD.max_turns, show_default=True)
@click.option(
    "--max-prompt-tokens",
    type=PROMPT,
    default=WORKLOAD.max_prompt_tokens,
    show_default=True,
    help="Drop a session's turns from the first longer prompt on (after scaling).",
)
@click.option(
    "--openings",
    type=click.Choice(OPENINGS),
    default=WORKLOAD.openings,
    show_default=True,
    help="'distinct': each session of a Mooncake trace opens with a block of its own instead of "
    "the block every request shares (per-user system prompts).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    default=BENCH.policies,
    show_default=True,
    help="Routing policies (repeat): sticky, alternate, swap-P, escalate-K, router-N, "
    "router-WORD[,WORD...].",
)
@click.option(
    "--mode",
    "modes",
    multiple=True,
    type=click.Choice(MODES),
    default=BENCH.modes,
    show_default=True,
    help="How swapped requests are served (repeat); reprefill always runs, as the reference.",
)
@click.option(
    "--quality-tokens",
    type=COUNT,
    default=BENCH.quality_tokens,
    show_default=True,
    help="Greedy answer tokens judged on each swapped request.",
)
@click.option(
    "--continuation-tokens",
    type=click.IntRange(1, MAX_CONTINUATION_TOKENS),
    default=WORKLOAD.continuation_tokens,
    show_default=True,
    help="Tokens of the trace's held-out text after each prompt on which swapped requests are "
    "scored against re-prefill, staying on the source model and no prefix.",
)
@click.option(
    "--device-tokens",
    type=click.IntRange(min=64),
    default=BENCH.device_tokens,
    show_default=True,
    help="Each engine's device KV pool in tokens (its host pool holds twice that).",
)
@click.option("--seed", type=AMOUNT, default=BENCH.seed, show_default=True)
@click.option(
    "--tail-pages",
    type=COUNT,
    default=BENCH.tail_pages,
    show_default=True,
    help="Last pages of a translated run the tail mode recomputes.",
)
@click.option(
    "--page-size",
    type=click.IntRange(1, MAX_PAGE_SIZE),
    default=WORKLOAD.page_size,
    show_default=True,
    help="Tokens per KV page (sglang-args' --page-size); the scaled trace blocks must fill "
    "whole pages.",
)
@click.option(
    "--prefetch-threshold",
    type=COUNT,
    default=BENCH.prefetch_threshold,
    show_default=True,
    help="Tokens a stored run needs before an engine fetches it (sglang-args' "
    "--prefetch-threshold).",
)
@click.option(
    "--warm-opening/--cold-opening",
    default=True,
    show_default=True,
    help="Every engine serves the prefix all the trace's prompts share (a system prompt) "
    "before the replay, so a swap's first pages are its own, as `sgl-kvmap warm` does in "
    "the serving recipe; --cold-opening starts the engines empty.",
)
@click.option(
    "--sinks",
    type=click.Choice(SINK_POLICIES),
    default=BENCH.sinks,
    show_default=True,
    help="Whether the engines may translate a prefix's first page (sglang-args' --sinks).",
)
@click.option(
    "--first-layer",
    type=click.Choice(FIRST_LAYER_POLICIES),
    default=StorageSettings.first_layer,
    show_default=True,
    help="Whether the engines serve the pack's map of layer 0 for translated tokens or their "
    "own (sglang-args' --first-layer).",
)
@click.option(
    "--derived",
    type=click.Choice(DERIVED_POLICIES),
    default=StorageSettings.derived,
    show_default=True,
    help="Whether the engines share the pages they compute over translated KV for their peers "
    "to translate (sglang-args' --derived).",
)
@click.option(
    "--quality-floor",
    type=FloorType(),
    default=BENCH.quality_floor,
    help="The engines' floor on the gap closed a pack records (see sglang-args). Default: "
    "none, so the modes measure what translation does with the packs at hand.",
)
@click.option(
    "--store",
    type=click.Choice(INNER_BACKENDS),
    default=BENCH.store,
    show_default=True,
    help="The store the engines share, fresh for each replay: file (a folder), or mooncake (a "
    "mooncake_master started on 127.0.0.1, each engine or --live server with its own client).",
)
@click.option(
    "--live",
    is_flag=True,
    help="Replay against two live sglang.launch_server processes started as sglang-args "
    "prints them (restarted for every replay) instead of in-process engines.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default=None,
    help="With --live: SGLang's engine (default: cuda when there is a GPU, else cpu).",
)
@click.option(
    "--port",
    type=PORT,
    default=EngineSpec.port,
    show_default=True,
    help="With --live: the small model's server port (the large one's is the next).",
)
@click.option(
    "--store-path",
    default=STORE_PATH,
    show_default=True,
    help="With --live: the folder under which each replay's store and the servers' logs go.",
)
@click.option(
    "--out",
    default="kvmap-bench",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for records.jsonl, run.json, summary.md and the plots (replaced if it holds "
    "an earlier run).",
)
@click.option(
    "--record",
    is_flag=True,
    help="Also write each pack's served figures (retention and gap closed of the swaps it "
    "translated, per translating mode) into its metrics: engines served as this run served "
    "(page size, tail, sinks) check these against their --quality-floor before the library's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary rows as JSON.")
@click.pass_context
def bench(
    ctx,
    small,
    large,
    pack_up,
    pack_down,
    trace,
    scale,
    sessions,
    min_turns,
    max_turns,
    max_prompt_tokens,
    openings,
    policies,
    modes,
    quality_tokens,
    continuation_tokens,
    device_tokens,
    seed,
    tail_pages,
    page_size,
    prefetch_threshold,
    warm_opening,
    sinks,
    first_layer,
    derived,
    quality_floor,
    store,
    live,
    device,
    port,
    store_path,
    out,
    record,
    as_json,
) -> None:
    """Benchmark prefix reuse across model swaps on a request trace.

    Sessions of the trace are routed between a small and a large model by each policy and
    replayed in each mode on two SGLang engines that share a store through sgl-kvmap's storage
    backend, launched as ``sglang-args`` launches them (page size, prefetch policy and the
    deadline it measures on this machine): in-process engines (SGLang's radix tree, HiCache
    host pool and storage threads, driven through the scheduler's calls), or with --live two
    sglang.launch_server processes. Writes one record per request, a summary and plots, and
    prints the summary.
    """
    import dataclasses

    from tqdm import tqdm

    from .bench.report import summarize, summary_markdown
    from .bench.run import check_out, header, pair_and_packs, record_in_packs, save_run
    from .sglang.launch import measured_deadline

    check_out(out)
    _check_store(store)

    workload = _config(
        ctx,
        WorkloadConfig,
        trace,
        scale,
        sessions,
        min_turns,
        max_turns,
        max_prompt_tokens,
        continuation_tokens=continuation_tokens,
        page_size=page_size,
        openings=openings,
    )
    config = _config(
        ctx,
        BenchConfig,
        workload,
        policies,
        modes,
        quality_tokens,
        device_tokens,
        seed,
        quality_floor=quality_floor,
        tail_pages=tail_pages,
        warm_opening=warm_opening,
        sinks=sinks,
        first_layer=first_layer,
        derived=derived,
        prefetch_threshold=prefetch_threshold,
    )
    given = {
        pair: _pack_folder(pack)
        for pair, pack in ((("small", "large"), pack_up), (("large", "small"), pack_down))
        if pack
    }
    names, packs = pair_and_packs(small, large, given)
    downloaded = [pack for pack in packs.values() if Path(pack).parent.name == "snapshots"]
    if record and downloaded:
        raise click.BadParameter(
            f"{downloaded[0]} is a download in the Hugging Face cache; copy it (cp -rL), pass "
            "the copy (--pack-up/--pack-down) and record into it",
            ctx,
            param_hint="'--record'",
        )
    device = device or ("cuda" if _has_gpu() else "cpu")
    deadline, lines = measured_deadline(
        list(packs.values()), device=device if live else "cpu", page_size=page_size
    )
    for line in [*lines, *_bench_floor_lines(names, packs)]:
        click.echo(f"# {line}", err=True)
    config = dataclasses.replace(config, deadline=deadline, store=store)
    run = _live_bench if live else _in_process_bench
    with tqdm(total=None, desc="requests", unit="req") as bar:
        turns, records, engines = run(names, packs, config, bar, device, port, store_path)
    run_header = header(config, names, packs, turns, _command_line(), engines)
    summary = save_run(records, run_header, out)
    for line in record_in_packs(records, config, packs, run_header) if record else []:
        click.echo(line, err=True)
    if as_json:
        click.echo(json.dumps(summarize(records), indent=2, default=str))
    else:
        click.echo(summary_markdown(records, run_header))
        click.echo(f"records, summary and plots written to {summary.parent}/")


def _check_store(store: str) -> None:
    """Refuse, before any work, a store the bench cannot run here (one line)."""
    if store != "mooncake":
        return
    from .sglang.mooncake_master import unavailable

    reason = unavailable()
    if reason:
        raise KVMapError(f"--store mooncake: {reason}")


def _bench_floor_lines(names: dict[str, str], packs: dict) -> list[str]:
    """What engines that sglang-args launches at its default floor would make of these packs
    (the bench's own engines use --quality-floor)."""
    from .sglang.launch import EngineSpec, LaunchOptions, floor_lines, peers_of

    engines = [EngineSpec(names[role], role) for role in ("small", "large")]
    peers = peers_of(engines, list(packs.values()))
    return [f"with sglang-args' defaults: {line}" for line in floor_lines(peers, LaunchOptions())]


def _in_process_bench(names, packs, config, bar, device, port, store_path):
    """The benchmark's replays on in-process engines: (turns, records, what served them)."""
    from .bench.replay import Deployment
    from .bench.run import replays_of, run_bench
    from .bench.workload import load_workload
    from .models.capture import load_model

    deployment = Deployment({role: load_model(name) for role, name in names.items()}, names, packs)
    turns = load_workload(config.workload, deployment.models["large"].tokenizer)
    bar.total = replays_of(turns, config)
    records = run_bench(deployment, turns, config, on_request=lambda _: bar.update())
    return turns, records, "in-process SGLang engines, CPU"


def _live_bench(names, packs, config, bar, device, port, store_path):
    """The benchmark's replays on live servers (``bench.live_run``): (turns, records, what
    served them)."""
    from transformers import AutoTokenizer

    from .bench.live_run import LiveSetup, run_live
    from .bench.run import replays_of
    from .bench.workload import load_workload
    from .core.sources import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(names["large"], weights=False))
    turns = load_workload(config.workload, tokenizer)
    bar.total = replays_of(turns, config)
    options = LaunchOptions(
        store_path=store_path,
        page_size=config.workload.page_size,
        device=device,
        max_total_tokens=config.device_tokens,
        quality_floor=config.quality_floor,
        prefetch_threshold=config.prefetch_threshold,
        sinks=config.sinks,
        first_layer=config.first_layer,
        derived=config.derived,
    )
    logs = Path(store_path) / "logs"
    setup = LiveSetup(names, packs, options, port, config.deadline, logs, store=config.store)
    records = run_live(turns, config, setup, on_request=lambda _: bar.update())
    return turns, records, f"live SGLang servers, {device} (logs in {logs})"


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


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
    help="Built-in HiCache store the engines share (file: one node; mooncake: engines on "
    "several hosts, with --mooncake-master).",
)
@click.option(
    "--mooncake-master",
    default="",
    help="With --store mooncake: the Mooncake master's HOST:PORT (RPC), reachable from every "
    "engine's host.",
)
@click.option(
    "--mooncake-metadata",
    default="",
    help="With --store mooncake: the HTTP metadata server's URL (default: the master's, "
    "http://HOST:8080/metadata).",
)
@click.option(
    "--store-path",
    type=click.Path(file_okay=False, resolve_path=True),
    default=STORE_PATH,
    show_default=True,
)
@click.option(
    "--page-size",
    type=click.IntRange(1, MAX_PAGE_SIZE),
    default=PAGE_SIZE,
    show_default=True,
    help="Tokens per KV page.",
)
@click.option(
    "--port",
    type=PORT,
    default=EngineSpec.port,
    show_default=True,
    help="First engine's port (+1 each).",
)
@click.option(
    "--tp",
    "tp_size",
    type=COUNT,
    default=EngineSpec.tp_size,
    show_default=True,
    help="Tensor parallel size.",
)
@click.option(
    "--prefetch-policy",
    type=click.Choice(PREFETCH_POLICIES),
    default=PrefetchDeadline.policy,
    show_default=True,
    help="SGLang's prefetch stop policy for engines that translate; with timeout, the deadline "
    "is set from the packs' translation time measured on this machine.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default=DEVICES[0],
    show_default=True,
    help="SGLang's engine: cuda, or its CPU engine (SGLANG_USE_CPU_ENGINE=1, torch-native "
    "attention).",
)
@click.option(
    "--max-total-tokens",
    type=COUNT,
    default=None,
    help="Size of every engine's KV pool in tokens (default: SGLang sizes it from free memory).",
)
@click.option(
    "--tail-pages",
    type=AMOUNT,
    default=StorageSettings.tail_pages,
    show_default=True,
    help="Last pages of a translated run the receiving engine computes itself.",
)
@click.option(
    "--concurrent-translations",
    type=click.IntRange(1, MAX_CONCURRENT_TRANSLATIONS),
    default=StorageSettings.concurrent_translations,
    show_default=True,
    help="Swaps an engine translates at once (a swap beyond them is prefilled); the deadline "
    "is timed for this many.",
)
@click.option(
    "--quality-floor",
    type=FloorType(),
    default=StorageSettings.quality_floor,
    show_default=True,
    help="Translate with a pack only when the gap closed it records (sgl-kvmap eval --record) "
    "is above this; 0: better than staying on the source model; 'none': any pack.",
)
@click.option(
    "--retention-floor",
    type=click.FloatRange(0, 1),
    default=StorageSettings.retention_floor,
    show_default=True,
    help="For a pack whose target does not beat its source (no gap to close): the retention it "
    "must record (translated accuracy over the target's own).",
)
@click.option(
    "--prefetch-threshold",
    type=COUNT,
    default=PREFETCH_THRESHOLD,
    show_default=True,
    help="Tokens a stored run needs before an engine fetches it from the store (SGLang's own "
    "is 256; it raises any value to one page). Below SGLang's, short swapped runs are "
    "translated instead of prefilled.",
)
@click.option(
    "--sinks",
    type=click.Choice(SINK_POLICIES),
    default=StorageSettings.sinks,
    show_default=True,
    help="'native': an engine computes a prefix's first page (its attention sinks) itself and "
    "translates only after it, so a swap whose opening it never served is prefilled; "
    "'translate': it also translates that page, and every later request sharing it reads it "
    "translated.",
)
@click.option(
    "--first-layer",
    type=click.Choice(FIRST_LAYER_POLICIES),
    default=StorageSettings.first_layer,
    show_default=True,
    help="'exact': an engine serves its own layer 0 for translated tokens, their ids read back "
    "from the peer's stored layer-0 values (both models' weights must be on the engine's "
    "host); 'mapped': the pack's map of layer 0.",
)
@click.option(
    "--derived",
    type=click.Choice(DERIVED_POLICIES),
    default=StorageSettings.derived,
    show_default=True,
    help="'share': an engine stores the pages it computes over translated KV apart (never as "
    "its own) and translates its peers' pages stored so, so a swap back after a swap still "
    "translates; 'withhold': such pages are stored nowhere.",
)
@click.option(
    "--audit-translations",
    is_flag=True,
    help="Also keep every page an engine receives translated in its store (key + "
    "'.translated'), to check translations against their source.",
)
@click.pass_context
def sglang_args(ctx, engines, packs, store, mooncake_master, mooncake_metadata, store_path,
                page_size, port, tp_size, prefetch_policy, device, max_total_tokens, tail_pages,
                concurrent_translations, prefetch_threshold, quality_floor, retention_floor, sinks,
                first_layer,
                derived, audit_translations):  # fmt: skip
    """Print the SGLang launch command of every ENGINE, sharing prefixes through sgl-kvmap."""
    from .sglang.launch import (
        engine_commands,
        engine_spec,
        floor_lines,
        measured_deadline,
        mooncake_lines,
        peers_of,
        shell_line,
    )

    if port + len(engines) - 1 > PORT.max:
        raise click.BadParameter(
            f"the last of {len(engines)} engines would get port {port + len(engines) - 1}",
            ctx,
            param_hint="'--port'",
        )
    specs = [engine_spec(engine, port + i, tp_size) for i, engine in enumerate(engines)]
    peers = peers_of(specs, list(packs))  # every pack between two engines, before timing any
    options = LaunchOptions(
        store, store_path, page_size, device, max_total_tokens, tail_pages,
        concurrent_translations, audit_translations, quality_floor, mooncake_master,
        mooncake_metadata, prefetch_threshold, sinks, first_layer, derived,
        retention_floor=retention_floor,
    )  # fmt: skip
    deadline, lines = measured_deadline(
        list(packs),
        prefetch_policy,
        concurrent=concurrent_translations,
        device=device,
        page_size=page_size,
    )
    for line in [*lines, *floor_lines(peers, options)]:
        click.echo(f"# {line}")
    if packs and deadline.policy == "timeout":
        click.echo(
            f"# prefetch deadline: {deadline.base:g} s + {deadline.per_ki_token:g} s per 1K "
            f"tokens ({deadline.seconds(2048):.1f} s at 2,048 tokens, "
            f"{deadline.seconds(8192):.1f} s at 8,192)"
        )
    commands = engine_commands(specs, list(packs), options, deadline)
    for line in mooncake_lines(options) if store == "mooncake" else []:
        click.echo(line)
    for spec, argv in zip(specs, commands):
        click.echo(f"# {spec.name}")
        click.echo(shell_line(argv))


def _server_urls(ctx: click.Context, param: click.Parameter, urls: tuple[str, ...]):
    for url in urls:
        if not _http_url(url):
            raise click.BadParameter(f"expected http://HOST:PORT, got {url!r}", ctx, param)
    return urls


def _http_url(url: str) -> bool:
    """Whether ``url`` is an http(s) URL with a host and, if it names one, a port that can be."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not one (99999, "x")
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def _opening(ctx: click.Context, text_file: Path | None, ids_file: Path | None):
    """The opening as text or token ids, from exactly one of --opening / --opening-ids."""
    if (text_file is None) == (ids_file is None):
        raise click.UsageError("give the opening as one of --opening FILE or --opening-ids FILE")
    hint = "'--opening'" if text_file is not None else "'--opening-ids'"
    path = text_file if text_file is not None else ids_file
    if not path.is_file() or path.stat().st_size > MAX_OPENING_BYTES:
        raise click.BadParameter(
            f"expected a regular file of at most {MAX_OPENING_BYTES:,} bytes", ctx, param_hint=hint
        )
    if text_file is not None:
        try:
            text = text_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise click.BadParameter(f"not UTF-8 text: {error}", ctx, param_hint=hint) from None
        if not text:
            raise click.BadParameter("the file is empty", ctx, param_hint="'--opening'")
        return text
    from .core.strict_json import loads_finite

    try:
        ids = loads_finite(ids_file.read_bytes())
    except ValueError as error:
        raise click.BadParameter(f"not JSON: {error}", ctx, param_hint="'--opening-ids'") from None
    if not isinstance(ids, list) or not ids or any(type(i) is not int or i < 0 for i in ids):
        raise click.BadParameter(
            "expected a non-empty JSON list of token ids (whole numbers >= 0)",
            ctx,
            param_hint="'--opening-ids'",
        )
    return ids


@main.command()
@click.argument("urls", nargs=-1, required=True, callback=_server_urls)
@click.option(
    "--opening",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A text file: the opening every session shares, exactly as requests begin (a system "
    "prompt with its chat-template markup). The servers tokenize it.",
)
@click.option(
    "--opening-ids",
    "ids_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A JSON file: the opening as a list of token ids.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    callback=_finite,
    default=600.0,
    show_default=True,
    help="Seconds to wait for each server to be healthy.",
)
@click.pass_context
def warm(ctx, urls, text_file, ids_file, timeout) -> None:
    """Serve the opening all sessions share on each SGLang server at URLS once, so every engine
    holds it as its own KV and a swap translates only what follows it."""
    from .sglang.warm import warm as warm_servers

    opening = _opening(ctx, text_file, ids_file)
    for warmed in warm_servers(urls, opening, timeout):
        click.echo(warmed.line())


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
@click.option("--force", is_flag=True, help="Download the pack again even if it is in the cache.")
def pull(repo_id, revision, force) -> None:
    """Fetch the pack REPO_ID into the Hugging Face cache, verify it, print its folder (a
    cached copy that fails its check is downloaded again)."""
    from .registry.packs import pull_pack

    click.echo(str(pull_pack(repo_id, revision=revision, force=force)))


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
@click.option(
    "--nproc",
    type=COUNT,
    default=None,
    help="Processes a --build fits in (torchrun; one device each unless --device-map). Default: "
    "one per visible GPU (1 with --device-map).",
)
@placement_options
@click.pass_context
def resolve(
    ctx,
    source,
    target,
    build,
    offline,
    allow_mismatch,
    namespace,
    nproc,
    device_map,
    max_memory,
    offload_folder,
) -> None:
    """Find the pack for SOURCE -> TARGET (local cache, then Hub, then --build); print its
    folder, and its recipe on stderr. Without --build any pack built here is taken, the
    default recipe's first; with --build only the default recipe's, built if missing."""
    from .registry.resolve import pack_recipe, resolve_pack

    placement = _placement(ctx, device_map, max_memory, offload_folder)
    nproc = nproc or default_nproc(sharded=placement is not None)
    if build:
        each = "" if placement is None else ", each model across its process's devices"
        click.echo(f"a build fits in {nproc} process(es){each}", err=True)
    folder = resolve_pack(
        source,
        target,
        build=build,
        local_files_only=offline,
        allow_mismatch=allow_mismatch,
        namespace=namespace,
        nproc=nproc,
        placement=placement,
    )
    click.echo(str(folder))
    click.echo(f"recipe {pack_recipe(folder)}", err=True)


@main.command(name="list")
@click.option("--remote", is_flag=True, help="List the packs on the Hub instead of the cache.")
def list_(remote) -> None:
    """List the packs in the local caches (or on the Hub), local ones with their recipe."""
    from .registry.packs import cached_packs, hub_packs
    from .registry.resolve import built_packs

    entries = hub_packs() if remote else built_packs() + cached_packs()
    for entry in entries:
        recipe = "" if entry.recipe is None else f"recipe {entry.recipe}  "
        click.echo(
            f"{entry.repo_id}  {(entry.commit or '-')[:12]}  {entry.source} -> {entry.target}  "
            f"{recipe}{entry.where}"
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
    from .core.pack import is_hub_pack, read_config
    from .core.spec import check_models, spec_from_pretrained
    from .registry.packs import fetch_pack

    folder = fetch_pack(pack, revision=revision) if is_hub_pack(pack) else Path(pack)
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

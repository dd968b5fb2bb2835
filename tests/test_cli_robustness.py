"""The command line against input it must refuse in one clear line and readers that leave
early (issue 34): a speed prompt past the target's positions, a model folder without a
tokenizer, control characters in what the user typed, a closed stdout pipe."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sgl_kvmap.cli import main
from sgl_kvmap.core.errors import KVMapError

from .conftest import char_tokenizer, save_loaded
from .test_cli import fail_in_one_line, succeed, tiny_fit

ROOT = Path(__file__).resolve().parents[1]
TYPED = "model\x1b[31mred\nline\rCR"  # a terminal colour, a line break, a carriage return
SHOWN = "model\\x1b[31mred\\nline\\rCR"  # the same, as the error line shows it


@pytest.fixture(scope="module")
def models(tiny_pair, tmp_path_factory):
    """The tiny pair as model folders ("src", "tgt"), a pack between them ("pack"), and copies
    of both folders without their tokenizer files ("src_bare", "tgt_bare")."""
    root = tmp_path_factory.mktemp("robust")
    dirs = {"src": save_loaded(tiny_pair[0], root / "src")}
    dirs["tgt"] = save_loaded(tiny_pair[1], root / "tgt")
    for name in ("src", "tgt"):
        bare = root / f"{name}_bare"
        bare.mkdir()
        for file in Path(dirs[name]).iterdir():
            if not file.name.startswith("tokenizer"):
                shutil.copy(file, bare / file.name)
        dirs[f"{name}_bare"] = str(bare)
    texts = root / "texts"
    texts.mkdir()
    for i, path in enumerate(sorted((ROOT / "sgl_kvmap").rglob("*.py"))[:30]):
        (texts / f"{i}_{path.name}").write_text(path.read_text())
    dirs["texts"] = str(texts)
    succeed(
        tiny_fit((dirs["src"], dirs["tgt"]), root / "pack", texts)
        + ["--top-k", "2", "--tune-steps", "0"]
    )
    dirs["pack"] = str(root / "pack")
    return dirs


def never(*args, **kwargs):
    raise AssertionError("loaded a model before refusing the input")


# -- 1. eval --speed-tokens past the target's positions ---------------------------------


def test_a_speed_prompt_past_the_targets_positions_is_refused_before_any_model_loads(
    models, monkeypatch
):
    """Before: the whole evaluation ran, then building a 10**8-token prompt out of the stdlib
    ended in a StopIteration traceback."""
    from sgl_kvmap.models import capture

    monkeypatch.setattr(capture, "load_models_for", never)
    monkeypatch.setattr(capture, "load_model", never)
    result = CliRunner().invoke(main, ["eval", models["pack"], "--speed-tokens", "100000000"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--speed-tokens'" in result.stderr
    assert "100,000,000 tokens is longer than the target model reads (512 positions)" in (
        " ".join(result.stderr.split())
    )


def test_a_speed_prompt_longer_than_the_text_is_refused_in_one_line(monkeypatch, tmp_path):
    """A model that states no position limit: the timing prompt the text cannot fill is a
    KVMapError that names it (before: StopIteration)."""
    from sgl_kvmap.fitting import texts

    (tmp_path / "short.py").write_text("x = 1\n" * 20)
    monkeypatch.setattr(texts, "stdlib_files", lambda: [tmp_path / "short.py"])
    with pytest.raises(KVMapError, match="no standard library source file holds a prompt of"):
        texts.prompt_of_length(char_tokenizer(), 10**8)
    assert texts.prompt_of_length(char_tokenizer(), 50).numel() == 50


# -- 2. a model folder without a tokenizer ------------------------------------------------


@pytest.mark.parametrize(
    "command, bare",
    [
        (["fit", "{src_bare}", "{tgt_bare}", "--out", "{out}"], "src_bare"),  # was: 0 windows
        (["fit", "{src}", "{tgt_bare}", "--out", "{out}"], "tgt_bare"),  # was: tokenizers differ
        (["eval", "{pack}", "--source", "{src_bare}"], "src_bare"),  # was: fingerprints differ
        (["eval", "{pack}", "--target", "{tgt_bare}", "--texts", "{texts}"], "tgt_bare"),
        (["tune", "{pack}", "--out", "{out}", "--target", "{tgt_bare}"], "tgt_bare"),
    ],
)
def test_a_model_folder_without_a_tokenizer_is_named_as_such(models, tmp_path, command, bare):
    args = [arg.format(**models, out=tmp_path / "out") for arg in command]
    line = fail_in_one_line(args)
    assert f"{models[bare]} has no tokenizer" in line and "tokenizer.json" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["sglang-args", "--engine", "{empty}"],
        ["eval", "{pack}", "--source", "{empty}"],
        ["fit", "{src}", "{empty}", "--out", "{out}"],
    ],
)
def test_a_folder_that_holds_no_model_is_named_as_such(models, tmp_path, command):
    """A folder with no config.json (a typo'd path that happens to exist) is refused in one
    line, not with transformers' traceback about a missing ``model_type``."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    args = [arg.format(**models, empty=empty, out=tmp_path / "out") for arg in command]
    line = fail_in_one_line(args)
    assert f"{empty} is a folder, but not a model's: it has no config.json" in line
    assert not (tmp_path / "out").exists()


# -- 3. control characters in what the user typed -----------------------------------------


@pytest.mark.parametrize(
    "args, exit_code",
    [
        (["inspect", TYPED], 1),
        (["eval", TYPED], 1),
        (["fit", TYPED, "{tgt}", "--out", "{out}"], 1),
        (["eval", "{pack}", "--source", TYPED], 1),
        (["verify", "{pack}", "--target", TYPED], 1),
        (["sglang-args", "--engine", TYPED], 1),
        (["sglang-args", "--engine", "{src}", "--pack", TYPED], 2),  # click's usage error
        (["eval", "{pack}", "--texts", TYPED], 2),  # click's own message (repr)
    ],
)
def test_control_characters_in_model_ids_and_paths_are_shown_escaped(
    models, tmp_path, args, exit_code
):
    """Before: printed raw (a terminal turned the rest red, a carriage return overwrote the
    line, a line break split it) or, with click stripping colours off a pipe, shown as
    something else than was typed."""
    args = [arg.format(**models, out=tmp_path / "out") for arg in args]
    result = CliRunner().invoke(main, args, color=True)  # colours kept, as on a terminal
    assert result.exit_code == exit_code, result.output
    message = result.stderr.splitlines()[-1]
    assert SHOWN in message or repr(TYPED)[1:-1] in message, result.stderr
    assert not any(c in result.output for c in "\x1b\r"), result.output
    if exit_code == 1:  # one line on stderr (verify prints what it checked before it)
        assert result.stderr.count("\n") == 1


# -- 4. a reader that closes stdout early -------------------------------------------------


def cli_into_closed_pipe(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``sgl-kvmap ARGS`` (this checkout) writing into a pipe whose reader closed it before
    the command wrote anything, as ``sgl-kvmap ... | head -0`` does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf")}
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "sgl_kvmap.cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("command", [["list"], ["inspect", "{pack}"], ["verify", "{pack}"]])
def test_a_closed_stdout_pipe_ends_the_command_quietly(models, tmp_path, command):
    """Before: ``error: [Errno 32] Broken pipe`` on stderr."""
    done = cli_into_closed_pipe([arg.format(**models) for arg in command], tmp_path)
    assert done.stderr == b"" and done.returncode == 1


def test_a_closed_pipe_in_a_shell_pipeline_prints_nothing(models, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf")}
    python = sys.executable
    line = f"{python} -m sgl_kvmap.cli inspect {models['pack']} | head -0; "
    line += f"{python} -m sgl_kvmap.cli list | true"
    done = subprocess.run(["bash", "-c", line], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout == b"" and done.stderr == b""


def test_a_broken_pipe_elsewhere_is_still_an_error_in_one_line(models, monkeypatch):
    """Only a reader that left stdout ends the command quietly: a broken pipe the library
    meets on its own (a server it writes to) is reported."""
    from sgl_kvmap.core.mapper import KVMapper

    def broken(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(KVMapper, "from_pretrained", broken)
    assert "Broken pipe" in fail_in_one_line(["inspect", models["pack"]])


def test_warm_refuses_what_it_cannot_send_before_touching_a_server(tmp_path):
    """``sgl-kvmap warm``: a URL without a scheme, no opening or two, an empty text file and ids
    that are not a list of whole numbers are refused by click's parsing, naming the option."""
    from .test_cli import refused_as_usage

    text, ids, empty = tmp_path / "opening.txt", tmp_path / "ids.json", tmp_path / "empty.txt"
    text.write_text("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    empty.write_text("")
    url = "http://127.0.0.1:9"
    refused_as_usage(["warm", "127.0.0.1:30000", "--opening", str(text)], "URLS...")
    for openings in ([], ["--opening", str(text), "--opening-ids", str(ids)]):
        ids.write_text("[1, 2, 3]")
        result = CliRunner().invoke(main, ["warm", url, *openings])
        assert result.exit_code == 2 and "one of --opening FILE or --opening-ids FILE" in (
            result.stderr
        )
    refused_as_usage(["warm", url, "--opening", str(empty)], "--opening")
    for bad in ("[]", "[1, -2]", "[1.5]", "[true]", '{"ids": [1]}', "[1, NaN]", "not json"):
        ids.write_text(bad)
        refused_as_usage(["warm", url, "--opening-ids", str(ids)], "--opening-ids")


def test_warm_refuses_inputs_that_hung_or_raised_before(tmp_path):
    """Before: ``--timeout nan`` passed click's range check and waited for ever, an opening read
    from a FIFO or /dev/zero never ended, a binary opening and URLs such as ``http://[::1`` or
    a port of 99999 ended in tracebacks. Each is now refused by the parsing, naming its
    option."""
    import os

    from .test_cli import refused_as_usage

    text, binary, fifo = tmp_path / "opening.txt", tmp_path / "opening.bin", tmp_path / "fifo"
    text.write_text("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    binary.write_bytes(b"\xff\xfe\x00\x81" * 16)
    os.mkfifo(fifo)
    url = "http://127.0.0.1:9"
    for timeout in ("nan", "inf"):
        refused_as_usage(["warm", url, "--opening", str(text), "--timeout", timeout], "--timeout")
    for opening in (fifo, "/dev/zero", binary):
        refused_as_usage(["warm", url, "--opening", str(opening)], "--opening")
    refused_as_usage(["warm", url, "--opening-ids", "/dev/zero"], "--opening-ids")
    for bad in ("http://[::1", "http://127.0.0.1:99999", "http://127.0.0.1:x", "http://:30000"):
        refused_as_usage(["warm", bad, "--opening", str(text)], "URLS...")


def test_warm_names_a_server_that_is_not_healthy_in_time(tmp_path):
    """A port where nothing listens: after --timeout seconds, one line naming the URL."""
    from .test_cli import fail_in_one_line

    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    line = fail_in_one_line(
        ["warm", "http://127.0.0.1:9", "--opening-ids", str(ids), "--timeout", "1"]
    )
    assert "http://127.0.0.1:9 did not answer GET /health with 200 within 1 s" in line

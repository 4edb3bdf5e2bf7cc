"""The ``inclavate`` command.

Each subcommand is one function ``add_<name>_command(subparsers)`` that builds its parser
and sets ``handler`` (a function of the parsed arguments returning the exit status). The
commands of other packages (peer, swarm, chat) live in their own modules and join by adding
their installer to :data:`COMMANDS`; nothing else here changes.

Exit statuses: 0 success, 1 an :class:`InclavateError` (printed as one ``error: ...`` line,
no traceback: these are the user's problems to fix, not bugs), 2 bad usage (argparse),
130 interrupted. Results go to stdout; progress, warnings and errors to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from inclavate import __version__
from inclavate.catalog import Catalog, ModelSpec
from inclavate.config import inclavate_home
from inclavate.errors import ConfigError, InclavateError
from inclavate.progress import Progress
from inclavate.terminal import printable
from inclavate.speech_catalog import SpeechCatalog
from inclavate.speech_store import SpeechStore
from inclavate.store import ModelStore, PullResult, PullStatus

log = logging.getLogger(__name__)

CommandInstaller = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def add_pull_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "pull",
        help="download and verify a model, or register a local GGUF file",
        description="Download a catalog model into the store and verify its sha256 "
        "(nothing is fetched when it is already there), or with --as register a GGUF "
        "file on this machine as a local model.",
    )
    parser.add_argument(
        "model", metavar="MODEL_ID|FILE", help="a catalog id (smollm2:135m) or, with --as, a .gguf path"
    )
    parser.add_argument("--as", dest="name", metavar="NAME", help="register FILE as local model NAME (e.g. mymodel:q4)")
    parser.add_argument("--speech", action="store_true",
                        help="MODEL_ID is a speech model (piper:joe, whisper:tiny.en); plain pull also finds them")
    parser.set_defaults(handler=_pull)


def add_models_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list catalog and local models and whether each is pulled",
        description="List the shipped catalog plus local models from config/models.toml.",
    )
    parser.set_defaults(handler=_models)


def _installers() -> tuple[CommandInstaller, ...]:
    # Imported here: these commands pull in the engine (llama.cpp) and the network stack,
    # which `inclavate pull` and `inclavate models` do not need to load.
    from inclavate.chat_cmd import add_chat_command
    from inclavate.generate_cmd import add_generate_command
    from inclavate.peer_cmd import add_peer_command
    from inclavate.status_cmd import add_status_command
    from inclavate.swarm_cmd import add_swarm_command

    return (
        add_pull_command,
        add_models_command,
        add_swarm_command,
        add_peer_command,
        add_status_command,
        add_chat_command,
        add_generate_command,
    )
"""Every subcommand, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inclavate",
        description="Run large language models across volunteers' machines.",
    )
    parser.add_argument("--version", action="version", version=f"inclavate {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for install in _installers():
        install(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status instead of exiting, for tests and embedding."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    _configure_logging(args.verbose, timestamps=getattr(args, "log_timestamps", False))
    try:
        status: int = args.handler(args)
        return status
    except InclavateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `inclavate models | head`: the reader left. Point stdout at devnull so the
        # interpreter's final flush does not raise a second time (Python docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _pull(args: argparse.Namespace) -> int:
    home = inclavate_home()
    store = ModelStore(home)
    progress = Progress(sys.stderr)
    catalog = Catalog.load(home)  # also stops a malformed overlay before anything is written
    if args.name is not None:
        shadowed = args.name in catalog and catalog.get(args.name).source == "catalog"
        spec = store.register_local(Path(args.model), args.name, progress)
        if shadowed:
            log.warning("local model %s now overrides the catalog entry of that name", spec.model_id)
        print(
            f"{spec.model_id}: registered {spec.local_path} ({spec.arch}, {spec.n_layers} layers, "
            f"d_model {spec.d_model}, {spec.quant_type}) at {store.path(spec)}"
        )
        return 0
    if _looks_like_file(args.model):
        raise ConfigError(f"{args.model} looks like a file; to use a local GGUF give it a name: "
                          f"inclavate pull {args.model} --as NAME")  # fmt: skip
    if args.speech or (args.model not in catalog and args.model in SpeechCatalog.load()):
        return _pull_speech(home, args.model, progress)
    spec = catalog.get(args.model)
    try:
        result = store.pull(spec, progress)
    except KeyboardInterrupt:
        print("interrupted: the partial download is kept and resumes on the next pull", file=sys.stderr)
        return 130
    print(_describe(spec, result))
    return 0


def _pull_speech(home: Path, model_id: str, progress: Progress) -> int:
    spec = SpeechCatalog.load().get(model_id)
    store = SpeechStore(home)
    status = store.pull(spec, progress)
    verb = "already pulled" if status is PullStatus.ALREADY_PULLED else "downloaded, sha256 verified"
    print(f"{spec.model_id}: {verb} ({spec.engine}, {len(spec.files)} files) at {store.model_dir(spec.model_id)}")
    return 0


def _looks_like_file(text: str) -> bool:
    # Model ids cannot contain a path separator or end in .gguf, so this never misfires.
    return text.endswith(".gguf") or "/" in text or "\\" in text or Path(text).is_file()


def _describe(spec: ModelSpec, result: PullResult) -> str:
    if result.status is PullStatus.ALREADY_PULLED:
        return f"{spec.model_id}: already pulled ({result.path})"
    check = "sha256 verified" if result.verified_against_catalog else "sha256 recorded, not in catalog"
    return f"{spec.model_id}: {result.status.value}, {check} ({result.sha256}) at {result.path}"


def _models(args: argparse.Namespace) -> int:
    home = inclavate_home()
    store = ModelStore(home)
    rows = [("ID", "ARCH", "LAYERS", "D_MODEL", "QUANT", "SOURCE", "PULLED")]
    for spec in Catalog.load(home).all():
        pulled = "yes" if store.is_pulled(spec) else "no"
        numbers = (str(spec.n_layers), str(spec.d_model))
        rows.append((spec.model_id, spec.arch, *numbers, spec.quant_type, spec.source, pulled))
    speech = SpeechStore(home)
    for voice in SpeechCatalog.load().all():  # speech models: ARCH is the engine, no layers
        rows.append((voice.model_id, voice.engine, "-", "-", "-", "catalog", "yes" if speech.is_pulled(voice) else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at emit time (tests swap it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


_OWN_PACKAGES = frozenset({"inclavate", "p2p", "node", "api"})
DEBUG_ENV = "INCLAVATE_DEBUG"
"""Loggers (comma-separated, e.g. ``p2p.pace``) logged at DEBUG whatever ``-v`` says: one
module's detail (a bench reads it from a peer's log) without every library's debug flood."""


def _message(record: logging.LogRecord) -> str:
    """The record's message, its text arguments each on one printable line and the whole
    without what a terminal acts on: arguments carry other machines' words (a stranger's
    admin command target, a header, a node's answer), and a logged escape sequence reached
    the operator's terminal, a logged newline forged a line of our own (an audit, 2026-12-07)."""
    args = record.args
    if isinstance(args, tuple) and args:
        record = logging.makeLogRecord({**record.__dict__, "args": tuple(
            a if isinstance(a, (int, float)) else _OneLine(a) for a in args)})  # fmt: skip
    return record.getMessage()


class _OneLine:
    """A log argument that formats (``%s``, ``%r``) on one printable line: an exception's
    text carries a frame's words too (a node id in a refusal forged a line: a review)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return printable(str(self.value), one_line=True)

    def __repr__(self) -> str:
        return printable(repr(self.value), one_line=True)


class _CliFormatter(logging.Formatter):
    def __init__(self, *, timestamps: bool = False) -> None:
        super().__init__()
        self._timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        line = self._line(record)
        if not self._timestamps:
            return line
        clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"{clock}.{int(record.msecs):03d} {line}"

    def _line(self, record: logging.LogRecord) -> str:
        message = _message(record)
        if record.exc_info and record.exc_info[1] is not None:
            if record.name.split(".")[0] in _OWN_PACKAGES:  # our bug: its traceback is what a report needs
                message += "\n" + self.formatException(record.exc_info)
            else:  # a library's (hypercorn's, for a client's broken request): one line, not a flood
                message += f": {record.exc_info[1]!r}"
        if "\n" in message and record.name.split(".")[0] not in _OWN_PACKAGES:  # py-libp2p's reports span lines
            first, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
            message = f"{first} {'; '.join(rest)}" if rest else first
        message = printable(message)  # tracebacks too: an exception's text may be a stranger's
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


def _configure_logging(verbosity: int, *, timestamps: bool = False) -> None:
    """One stderr handler on the root logger, added once even if main() runs repeatedly.
    ``timestamps``: for a long-running command's log (a peer's), where when something
    happened is half of what a line says; a one-shot command's messages go without.
    :data:`DEBUG_ENV` names loggers to log at DEBUG."""
    root = logging.getLogger()
    root.setLevel([logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)])
    for name in filter(None, os.environ.get(DEBUG_ENV, "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)
    if not any(isinstance(handler, _StderrHandler) for handler in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_CliFormatter(timestamps=timestamps))
        root.addHandler(handler)

"""`toolkit` command line: a thin shell over the library.

Each module in toolkit/commands registers its subcommand with `register(subparsers)` and sets a
handler `func(args) -> int`. Handlers import heavy libraries lazily, so `toolkit --help` is fast.
Errors the user can act on (ToolkitError) print as one line; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from toolkit import __version__
from toolkit.errors import ToolkitError

COMMAND_MODULES = ("convert", "quickstart", "ds_config", "memory", "plan", "plot", "slurm", "wandb_summary", "ckpt",
                   "parity", "data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolkit",
        description="Hugging Face <-> megatron-core conversion, DeepSpeed configs and 3D-parallel fine-tuning.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"toolkit.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; `argv` None: the process's own command line, and the process ends next."""
    code = _run(argv)
    if argv is None:
        _skip_collection_at_exit()
    return code


def _skip_collection_at_exit() -> None:
    """The interpreter's shutdown collects every object left, ~0.7 s once torch and transformers are
    imported (330k objects, 2,300 modules; measured by benchmarks/convert_bench.py as the exit
    phase): frozen, they are left to the process's end. Shutdown still runs: atexit handlers,
    thread joins and the flush of open files are unchanged; only cyclic garbage is not collected,
    which is freed with the process anyway. Not for an in-process call (tests, a library user)."""
    import gc

    gc.freeze()


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from toolkit.runtime.quiet import quiet_third_party

    quiet_third_party(verbose=args.debug)
    try:
        return int(args.func(args) or 0)
    except ToolkitError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader left (`toolkit ckpt inspect DIR | head`): end as a shell tool killed by
    SIGPIPE does, without a traceback; stdout goes to /dev/null so the exit flush cannot fail again."""
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())

"""One clear last line for every failure of the command-line tools; the details go to a log file it names
(or to the terminal with --verbose).

Why: orbax restores arrays in asyncio tasks; when one read fails, asyncio logs every other task's failure at
shutdown, each with a page of TensorStore spec: ~40,000 lines on stderr for a tiny checkpoint missing one
chunk file, ahead of the one line that says what to do. `captured_logs()` holds such library records back
while a block runs; `cli_main()` turns an exception into that one line.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager

LIBRARY_LOGGERS = ("asyncio", "absl", "orbax")  # orbax logs through absl; asyncio is the flood above
LOG_DIR_ENV = "K3JAX_LOG_DIR"
REPLAY_MAX = 20  # warnings of a block that succeeded are shown after it, at most this many
_verbose = False


def set_verbose(on: bool) -> None:
    """--verbose: library logs and tracebacks go straight to the terminal, as without this module."""
    global _verbose
    _verbose = bool(on)


def cache_root() -> str:
    """$K3JAX_CACHE, else $XDG_CACHE_HOME/k3jax, else ~/.cache/k3jax (the demo model and the logs live here)."""
    return os.environ.get("K3JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "k3jax"
    )


def new_log_path(prog: str) -> str:
    """A fresh log file path in $K3JAX_LOG_DIR, else the cache's logs/, else the temp directory."""
    name = f"{prog.replace(' ', '_').replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for d in (os.environ.get(LOG_DIR_ENV), os.path.join(cache_root(), "logs"), tempfile.gettempdir()):
        if not d:
            continue
        try:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, name)
            open(path, "a").close()
            return path
        except OSError:
            continue
    raise OSError("no writable directory for a log file")


class _Held(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


class Captured:
    """What `captured_logs()` held back; `save()` writes it (and the exception) to a log file."""

    def __init__(self, handler: _Held | None):
        self.handler = handler

    @property
    def records(self) -> list[logging.LogRecord]:
        return self.handler.records if self.handler else []

    def save(self, prog: str, exc: BaseException | None = None) -> str | None:
        """Write the held records and `exc`'s traceback to a new log file; its path (None when verbose: then
        everything already went to the terminal, or if no directory is writable)."""
        if self.handler is None:
            return None
        try:
            path = new_log_path(prog)
        except OSError:
            return None
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        with open(path, "a") as f:
            f.write(f"{prog}: {' '.join(sys.argv)}\n")
            if exc is not None:
                f.write("".join(traceback.format_exception(exc)))
            for r in self.records:
                f.write(fmt.format(r) + "\n")
        return path


@contextmanager
def captured_logs(names=LIBRARY_LOGGERS):
    """Hold back the records of `names` (and their children) while the block runs. If the block raises, the
    caller may `save()` them to a log file; if it succeeds, its warnings (at most REPLAY_MAX) are shown."""
    if _verbose:
        yield Captured(None)
        return
    held = _Held()
    saved = []
    for n in names:
        lg = logging.getLogger(n)
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers, lg.propagate = [held], False
    ok = False
    try:
        yield Captured(held)
        ok = True
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        if ok:
            for r in [r for r in held.records if r.levelno >= logging.WARNING][:REPLAY_MAX]:
                logging.getLogger(r.name).handle(r)


def cli_main(
    prog: str, fn: Callable[[], int], verbose: bool = False, label: str | None = None, refusals=(ValueError, OSError)
) -> int:
    """Run a command-line tool's body: a refusal (ours are ValueErrors whose message says what to do) is one
    line `PROG: error: ...`, exit 2; anything else is one line naming a log file with the traceback, exit 1;
    Ctrl-C is one line, exit 130. --verbose: library logs pass through and unexpected errors raise.
    `label` replaces the `PROG: ` in front of `error:`."""
    label = f"{prog}: " if label is None else label
    was = _verbose
    set_verbose(verbose)
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"{label}interrupted", file=sys.stderr)
        return 130
    except refusals as e:
        if verbose:
            traceback.print_exc()
        msg = str(e).strip() or type(e).__name__
        if len(msg) > LONG_MESSAGE or msg.count("\n") >= LONG_LINES:  # someone else's page-long ValueError
            path = None if verbose else Captured(_Held()).save(prog, e)
            msg = f"{_first_line(msg)} [...] ({f'the whole message is in {path}' if path else 'cut short'})"
        print(f"{label}error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:
        if verbose:
            raise
        path = Captured(_Held()).save(prog, e)
        where = f"the traceback is in {path}" if path else "no log file could be written"
        print(
            f"{label}error: unexpected {type(e).__name__}: {_first_line(str(e))} ({where}; --verbose prints it)",
            file=sys.stderr,
        )
        return 1
    finally:
        set_verbose(was)


LONG_MESSAGE, LONG_LINES = 2000, 5


def _first_line(msg: str) -> str:
    return (msg.strip().splitlines() or [""])[0][:300]

"""Keep vLLM's output (logs, warnings, progress bars, C++ warnings of engine processes) in a log file.

Logging levels do not reach everything: engine-core processes print Triton and NUMA notices, Python
warnings and weight-loading progress bars before any logger is configured. They all write to the file
descriptors they inherit, so redirecting descriptors 1 and 2 before the engines start sends all of it,
from this process and from every process it starts, to one file.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def output_to_log(log_path: str) -> Iterator[TextIO]:
    """Inside: file descriptors 1 and 2 (this process's and every child's started inside) write to
    `log_path` and Python warnings are ignored; yields a line-buffered stream on the original stdout for
    the program's own lines. Restored on exit (children started inside keep writing to the log)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield console
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        console.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def log_tail(log_path: str, lines: int = 30) -> str:
    """The last `lines` lines of the log (to show next to an error)."""
    with open(log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


@contextmanager
def quiet_run(out_dir: str, prefix: str) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A run whose vLLM output goes to `<out_dir>/<prefix>-<time>.log`: yields (the results' path stem,
    `say`, which prints one of the program's own lines on the console); on an error, the log's last
    lines are printed before it propagates."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, prefix + "-" + time.strftime("%Y%m%d-%H%M%S"))
    try:
        with output_to_log(stem + ".log") as console:
            yield stem, lambda line: print(line, file=console, flush=True)
    except BaseException:
        print(f"last lines of {stem}.log:\n{log_tail(stem + '.log')}", file=sys.stderr)
        raise

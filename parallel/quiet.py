"""Known library warnings hidden with their reasons; every other warning shown by one rank.

A job on N ranks runs the same library code N times, so each library warning reaches the console
N times, and most of them are about situations a run is not in (a CUDA tuning hint on a CPU
run, a deprecation in the library's own default). This module is the mechanism; the list of
what a run hides, each entry with the reason it does not apply, is the caller's (the training
job's is ``glm5_train/known_warnings.py``), like ``parallel/mcore_compat.py`` lists each change
to megatron-core with its reason.

- ``Known``: one warning: its category (or the logger that logs it), a message regex, the module
  that emits it, the library and the releases it was checked on, why it does not apply, and
  ``when``: for a reason that holds only sometimes (a CPU-only reason on a machine that may have
  a GPU), the condition under which it is hidden; the warning shows whenever it is false.
  On any other release of the library the entry is not applied: the warning shows again and
  someone judges it anew.
- ``install(entries, once_per_run=...)``: unconditional entries become ordinary
  ``warnings.filterwarnings`` filters (before the library is imported, for import-time
  warnings); conditional ones are checked by a ``warnings.showwarning`` hook when the warning
  is emitted; a logger's entries are a ``logging.Filter`` on that logger. Idempotent.
- ``OncePerRun``: the de-duplication of the warnings still shown, across the run's ranks.

Once per run, not once per rank: the design. Every rank that emits a warning claims it by
creating a file named after its text in a directory the run's local ranks share (``O_CREAT |
O_EXCL``: exactly one creator); the rank that creates it shows the warning, tagged with its
rank, then and whenever it recurs there; the other ranks drop it. Warnings and WARNING+ log records on the console go
through it (log files keep every rank's records). Why not the alternatives:

- only rank 0 shows warnings: a warning that only some other rank emits (its pipeline stage's
  layers, its expert group) would be lost, and we do not hide unknown warnings;
- ranks record, rank 0 gathers and prints a summary at a sync point: it could say "(all 8
  ranks)", but a warning would show late (at the next sync), not at all from a rank that
  crashes or hangs before the sync (when it matters most), and the gather is a collective the
  step does not otherwise need.

The file claim needs no communication, works before process groups exist (import time) and on
a rank about to crash, and costs one ``open`` per distinct warning and rank (Python itself
shows a warning once per code location). The claims are left in the temporary directory (a
few bytes per distinct warning, none for a run without any). What it gives up: which
other ranks emitted the same text (the console says which rank showed it, not that the others
matched), and on a multi-node run whose ranks share no temporary directory, de-duplication is
per node (once per node, not once per run). A failed claim (an unwritable directory) shows the
warning: an I/O problem never hides one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """One library warning that does not apply to the runs it is listed for, and why."""

    message: str  # regex, matched at the start of the text, case-insensitively (as warnings do)
    module: str  # the emitting module, or a package (all its modules); the logger for `logger`
    library: str  # distribution name, whose version decides whether the entry applies
    versions: tuple[str, ...]  # releases checked to emit it (public part: 2.13.0 for 2.13.0+cpu)
    why: str  # why it does not apply (under `when`)
    category: type[Warning] = UserWarning  # warnings.warn entries
    logger: bool = False  # a logging record (level >= WARNING) of logger `module`, not a warning
    when: Callable[[], bool] | None = None  # hidden only while this holds (checked at emission)

    def matches_text(self, text: str) -> bool:
        return re.match(self.message, text, re.IGNORECASE) is not None


@functools.cache  # read at every install (three per rank): ~1 ms a look-up
def installed_version(library: str) -> str | None:
    """The public version of an installed distribution (``2.13.0`` for ``2.13.0+cpu``)."""
    try:
        return importlib.metadata.version(library).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def applies_to_installed(entry: Known) -> bool:
    """Whether the installed release of the entry's library is one it was checked on."""
    return installed_version(entry.library) in entry.versions


def from_module(filename: str, module: str) -> bool:
    """Whether a warning attributed to ``filename`` comes from ``module`` (a module, or any
    module of a package): the ``showwarning`` hook gets the file, not the module name."""
    path = filename.replace(os.sep, "/")
    dotted = "/" + module.replace(".", "/")
    return path.endswith(dotted + ".py") or (dotted + "/") in path


# --------------------------------------------------------------------------- once per run


class OncePerRun:
    """Claims of warning texts, shared by the ranks of one run through ``directory``."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory, self.rank = directory, rank
        self._mine: set[str] = set()  # claim files this rank created

    def shows(self, text: str) -> bool:
        """Whether this rank shows ``text``: it was the first of the run's ranks to claim it
        (now or earlier: a warning that recurs, a log record each step, keeps showing on that
        one rank). Also True on an I/O failure, so that a problem here never hides a warning."""
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        if name in self._mine:
            return True
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(os.path.join(self.directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        except OSError:
            return True
        self._mine.add(name)
        try:  # who showed it, for whoever looks in the directory
            os.write(fd, f"rank {self.rank}: {text}\n".encode())
        finally:
            os.close(fd)
        return True


class _FirstRankOnly(logging.Filter):
    """On a console handler: a WARNING+ record passes on the first rank of the run to log it."""

    def filter(self, record: logging.LogRecord) -> bool:
        once = _STATE.once
        if once is None or record.levelno < logging.WARNING:
            return True
        return once.shows(f"{record.name}: {record.levelname}: {record.getMessage()}")


# -------------------------------------------------------------------------------- install


@dataclass
class _State:
    conditional: tuple[Known, ...] = ()  # warnings.warn entries with a `when`, installed
    once: OncePerRun | None = None
    shown_by: Callable | None = None  # warnings.showwarning before ours


_STATE = _State()
_LOG_FILTER = _FirstRankOnly()


def install(entries: Iterable[Known], once_per_run: OncePerRun | None = None) -> list[Known]:
    """Hide ``entries`` (those that apply to the installed library releases) in this process,
    and show the remaining warnings once per run (``once_per_run``; None: every one, as
    Python does). Returns the entries applied. Safe to call again: later calls replace the
    conditional entries and the de-duplication, and add no filter twice."""
    applied = [e for e in entries if applies_to_installed(e)]
    for entry in applied:
        if entry.logger:
            _add_logger_filter(entry)
        elif entry.when is None:
            warnings.filterwarnings("ignore", message=entry.message, category=entry.category,
                                    module=re.escape(entry.module) + r"(\.|\Z)")
    _STATE.conditional = tuple(e for e in applied if not e.logger and e.when is not None)
    _STATE.once = once_per_run
    if warnings.showwarning is not _show:
        _STATE.shown_by = warnings.showwarning
        warnings.showwarning = _show
    return applied


def once_on_console(root: logging.Logger | None = None) -> None:
    """De-duplicate WARNING+ log records across ranks on ``root``'s console handlers (stream
    handlers other than files: log files keep every rank's records). Call after logging is
    configured (Hydra replaces the root's handlers)."""
    for handler in (root or logging.getLogger()).handlers:
        if (isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                and _LOG_FILTER not in handler.filters):
            handler.addFilter(_LOG_FILTER)


def hidden(entries: Iterable[Known], text: str, category: type[Warning], filename: str) -> bool:
    """Whether an entry of ``entries`` hides this warning now (its ``when``, if any, holds)."""
    return any(issubclass(category, e.category) and e.matches_text(text)
               and from_module(filename, e.module) and (e.when is None or e.when())
               for e in entries)


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    """The ``warnings.showwarning`` hook: conditional entries, then once per run."""
    text = str(message)
    if hidden(_STATE.conditional, text, category, filename):
        return
    once = _STATE.once
    if once is None:
        _STATE.shown_by(message, category, filename, lineno, file, line)
        return
    if not once.shows(f"{filename}:{lineno}: {category.__name__}: {text}"):
        return
    out = file if file is not None else sys.stderr
    if out is None:  # no stderr (pythonw): nowhere to show it, as Python's own showwarning
        return
    try:
        out.write(f"[rank {once.rank}; not repeated for other ranks] "
                  + warnings.formatwarning(message, category, filename, lineno, line))
    except OSError:  # stderr closed: as Python's own showwarning, drop it
        pass


class _LoggerEntryFilter(logging.Filter):
    """On the entry's logger: drops its WARNING+ records that the entry matches."""

    def __init__(self, entry: Known) -> None:
        super().__init__()
        self.entry = entry

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not self.entry.matches_text(record.getMessage()):
            return True
        return not (self.entry.when is None or self.entry.when())


def _add_logger_filter(entry: Known) -> None:
    # Records propagate to the parent loggers' handlers without passing the parents' filters:
    # the filter must sit on the very logger that logs (megatron-core's are named by module).
    logger = logging.getLogger(entry.module)
    if not any(isinstance(f, _LoggerEntryFilter) and f.entry == entry for f in logger.filters):
        logger.addFilter(_LoggerEntryFilter(entry))

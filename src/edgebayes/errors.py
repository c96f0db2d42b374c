"""Errors with a message meant for the user. The CLI prints the message and exits non-zero.

InputError (exit 2): bad input found before any work (config, device profile, data files).
StageError (exit 1): a stage could not finish (a failed check, no operating point fits, the device runner
failed); artifacts of finished stages are kept and the stage can be re-run.
CorruptFileError (exit 1): a file that does not hold what it should (not JSON, not a loadable checkpoint).
warn_once: a warning said once per process (the CLI prints it as `edgebayes: warning: ...`).
"""

import warnings

_SAID = set()   # the warnings said in this process (warn_once)


def warn_once(message, stacklevel=3):
    """A warning said once per process: a net is converted, a pretrained file loaded, the device folders looked
    up, for every twin, stage and profile; the warnings module's own once-filter is reset by torch's exporters."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, stacklevel=stacklevel)


class InputError(Exception):
    pass


class StageError(Exception):
    pass


class CorruptFileError(StageError, ValueError):
    """The message names the file. Also a ValueError, as json's own error is, so that callers catching
    ValueError around a read keep working."""


class ArchError(InputError, ValueError):
    """`model.arch` names nothing that builds a network (train/arch.py), or a module cannot be made the
    net of a family (train/bayesianize.py); the message says what was tried."""


class UnreachableWithoutTable(StageError):
    """The device cannot be used and there is no latency table to predict from (deploy/selection.py): no
    report can be written. The CLI exits with the unreachable device's code (4), not a stage's failure (1)."""

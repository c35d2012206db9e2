"""Quiet DCP's single-process notice where elastictrain means it.

DCP called without a process group warns "torch.distributed is disabled, unavailable or uninitialized,
assuming the intent is to load (save) in a single process" on every call. elastictrain calls it that way on
purpose: a rank's load is collective-free by design (``parallel/train_state.py``), export reads in one
process, a one-rank writer saves alone; so on every worker the notice reached the console through Ray at
each checkpoint load. :func:`quiet_single_process_notice` ignores exactly that message, raised from DCP's
own modules, and nothing else; the code that calls DCP without a group calls it first.
"""

from __future__ import annotations

import warnings

_NOTICE = (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
           r"(load|save) in a single process")


def quiet_single_process_notice() -> None:
    """Install (idempotently) the one filter for DCP's single-process notice."""
    warnings.filterwarnings("ignore", message=_NOTICE, category=UserWarning, module=r"torch\.distributed\.checkpoint")

"""The one shape of every unpickler that reads checkpoint bytes from storage: an allow-list, never code.

A pickle from storage is attacker-controlled once someone can write to the bucket, and plain ``pickle.load``
runs whatever callable it names. :class:`AllowListUnpickler` resolves a global only when its ``(module, name)``
is in the subclass's ``allowed`` table (or :meth:`~AllowListUnpickler.extra_global` accepts it), refuses
persistent ids, and raises the subclass's ``refusal`` error naming what was asked for, before any object is
built from it. :func:`restricted_loads` wraps one load: a refusal passes through, anything else a truncated
or garbled pickle raises becomes one :class:`CheckpointError` that says the entry is corrupt.

Users: ``.metadata`` (:mod:`.safe_metadata`, DCP's metadata classes) and DCP bytes items
(:mod:`.safe_bytes`, plain data only).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any, ClassVar

from elastictrain.checkpoint.errors import CheckpointError


class AllowListUnpickler(pickle.Unpickler):
    """Unpickles only what ``allowed`` (module -> names) lists; subclasses set the table, the error type
    and the words of the refusal."""

    allowed: ClassVar[Mapping[str, frozenset[str]]] = {}
    refusal: ClassVar[type[CheckpointError]] = CheckpointError
    #: ends the refusal sentence: what this kind of pickle holds instead (e.g. "plain data only")
    holds: ClassVar[str] = "only what its allow-list names"

    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def extra_global(self, module: str, name: str) -> Any | None:  # noqa: ARG002 - a hook for subclasses
        """A value (not a callable to run) that a subclass accepts beyond the table; None refuses."""
        return None

    def find_class(self, module: str, name: str) -> Any:
        if name in self.allowed.get(module, ()):
            return super().find_class(module, name)
        value = self.extra_global(module, name)
        if value is not None:
            return value
        raise self.refusal(f"{self.where} refers to {module}.{name}, but it holds {self.holds}; refusing to load "
                           "it (the checkpoint may have been tampered with)")

    def persistent_load(self, pid: Any) -> Any:
        raise self.refusal(f"{self.where} holds a tensor storage reference, but it holds {self.holds}; refusing "
                           "to load it (the checkpoint may have been tampered with)")


def restricted_loads(unpickler: type[AllowListUnpickler], data: bytes, where: str) -> Any:
    """``data`` unpickled by ``unpickler``; its refusal passes through, any other failure (a truncated or
    garbled pickle raises many types) becomes a :class:`CheckpointError` saying the entry is corrupt."""
    try:
        return unpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt pickles raise anything from EOFError to UnicodeDecodeError
        raise CheckpointError(f"{where}: the entry is corrupt ({type(e).__name__}: {e})") from None

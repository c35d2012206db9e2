"""The one shape of every unpickler that reads checkpoint bytes from storage: an allow-list, never code.

A pickle from storage is attacker-controlled once someone can write to the bucket, and plain ``pickle.load``
runs whatever callable it names. :class:`AllowListUnpickler` resolves a global only when its ``(module, name)``
is in the subclass's ``allowed`` table (or :meth:`~AllowListUnpickler.extra_global` accepts it), refuses
persistent ids, and raises the subclass's ``refusal`` error naming what was asked for, before any object is
built from it. What it builds stays within the pickle's own size: ``bytes``/``bytearray`` take data, never a
count (``bytearray(N)`` is N bytes out of nothing), and ``_codecs.encode`` only the latin1 that protocol 2
writes. :func:`restricted_loads` wraps one load: a refusal passes through, anything else a truncated
or garbled pickle raises becomes one :class:`CheckpointError` that says the entry is corrupt.

Users: ``.metadata`` (:mod:`.safe_metadata`, DCP's metadata classes) and DCP bytes items
(:mod:`.safe_bytes`, plain data only).
"""

from __future__ import annotations

import codecs
import functools
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
            found = super().find_class(module, name)
            if found in (bytes, bytearray):
                return functools.partial(self._sized, found, f"{module}.{name}")
            if found is codecs.encode:
                return functools.partial(self._latin1, f"{module}.{name}")
            return found
        value = self.extra_global(module, name)
        if value is not None:
            return value
        raise self.refusal(f"{self.where} refers to {module}.{name}, but it holds {self.holds}; refusing to load "
                           "it (the checkpoint may have been tampered with)")

    def _sized(self, kind: type, spelled: str, *args: Any) -> Any:
        # bytes(N) / bytearray(N) would make N zero bytes from a few bytes of pickle, N unbounded; a pickler
        # never writes them with a count, only with the data itself
        if args and not isinstance(args[0], (bytes, bytearray, str)):
            raise self.refusal(f"{self.where} asks {spelled} for {args[0]!r} zero bytes out of nothing (a pickler "
                               "passes the bytes themselves); refusing to load it (the checkpoint may have been "
                               "tampered with)")
        return kind(*args)

    def _latin1(self, spelled: str, text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
        # how protocol 2 spells bytes: encode(str, "latin1"); any other codec is a lookup by name, not data
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
            raise self.refusal(f"{self.where} asks {spelled} for codec {encoding!r}, but a pickled bytes object "
                               "uses 'latin1' only; refusing to load it (the checkpoint may have been tampered with)")
        return codecs.encode(text, "latin1")

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

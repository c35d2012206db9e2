"""Loading DCP's bytes items (the non-tensor leaves of a state dict) without running code.

DCP saves every non-tensor leaf (``optim.param_groups.0.lr``, ``betas``, ``eps``, ``params``...) as a
``torch.save`` archive inside a ``.distcp`` file, and its stock load planner reads them back with
``torch.load(weights_only=False)``: a full unpickler over bytes that come from storage. Here a bytes item is
opened as the zip archive ``torch.save`` writes, its one ``data.pkl`` is unpickled with an allow-list of plain
data (numbers, strings, bytes, bools, None, and lists, tuples, dicts, sets of those) and no persistent ids
(a bytes item never holds a tensor; the unpickler's shape is :mod:`.restricted_pickle`'s), and anything else raises :class:`UnsafeBytesError` before an object is
built from it. :class:`SafeLoadPlanner` and :class:`SafeFullLoadPlanner` are DCP load planners that read
bytes items this way; :class:`~elastictrain.checkpoint.dcp_io.SafeReader` refuses to serve any other planner.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.restricted_pickle import AllowListUnpickler, restricted_loads

# module -> names a plain-data pickle (protocol 2, as torch.save writes it) may name
_PLAIN: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "complex", "bytes", "bytearray"}),  # bytes(): b"" in protocol 2
    "__builtin__": frozenset({"set", "frozenset", "complex", "bytes", "bytearray"}),  # protocol 2 from Python 2 names
    "_codecs": frozenset({"encode"}),  # how protocol 2 spells a bytes object: encode(str, "latin1")
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeBytesError(CheckpointError):
    """A bytes item holds something other than plain data; nothing was built from it."""


class _PlainUnpickler(AllowListUnpickler):
    allowed = _PLAIN
    refusal = UnsafeBytesError
    holds = "plain data only (a checkpoint's non-tensor entries)"


def loads_plain(data: bytes, where: str = "bytes item") -> Any:
    """The plain-data value of a ``torch.save`` archive ``data``; raise :class:`UnsafeBytesError` when it
    names anything but plain data, :class:`CheckpointError` when it is not such an archive."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise CheckpointError(f"{where}: expected one data.pkl in the archive, found {len(pickles)}")
            declared = archive.getinfo(pickles[0]).file_size
            if declared > len(data):  # a deflated member could unpack far beyond the bytes the manifest sized
                raise UnsafeBytesError(f"{where}: its data.pkl unpacks to {declared} bytes from a {len(data)}-byte "
                                       "item; refusing to load it (the checkpoint may have been tampered with)")
            payload = archive.read(pickles[0])
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{where}: not a torch.save archive ({e}); the checkpoint is corrupt") from None
    return restricted_loads(_PlainUnpickler, payload, where)


class _PlainBytes:
    """``load_bytes`` of DCP's default planner, with :func:`loads_plain` in place of ``torch.load``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = loads_plain(value.getvalue(), f"checkpoint entry {fqn!r}")
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    """DCP's default load planner, loading bytes items as plain data only (pass it to ``dcp.load``)."""


class SafeFullLoadPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds a whole state dict from the metadata (export), loading bytes items as plain data only."""


def is_safe_planner(planner: Any) -> bool:
    return isinstance(planner, _PlainBytes)

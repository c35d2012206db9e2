"""Old name of :mod:`elastictrain.worker_reply`, kept only while ``worker/actor.py`` and
``controller/monitor.py`` still import it (their owners switch the import; then delete this file)."""

from elastictrain.worker_reply import STATUSES, pack, unpack

__all__ = ["STATUSES", "pack", "unpack"]

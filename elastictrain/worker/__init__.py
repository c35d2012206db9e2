"""The worker side: the Ray actor, its step loop and what it calls.

A standby process lowers its CPU priority here (every thread, until a replacement takes it), before the
worker actor's heavy imports (torch): see :mod:`elastictrain.worker.import_priority`.
"""

from elastictrain.worker.import_priority import lower_if_standby

lower_if_standby()

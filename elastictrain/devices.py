"""Known accelerators: memory and dense bf16 peak, by the name Ray or torch gives a device.

One table for everything that needs a device's figures: the planner sizes a GPU cluster from it
(:func:`elastictrain.planner.cluster.from_ray`) and the step events' model-FLOPs utilisation divides by its
peak, and the driver refuses ``parallel.float8`` on a cluster whose GPUs all lack float8 (their compute
capability, :func:`elastictrain.preflight.check_float8_gpus`). Figures are the vendors' datasheet values for
the SXM/OAM parts (dense, no sparsity); a device this table does not know is ``None``, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator model: ``memory`` bytes, ``bf16_flops`` dense bf16 peak FLOP/s and ``capability``, its
    CUDA compute capability (None: not an NVIDIA part)."""

    name: str
    memory: float
    bf16_flops: float
    capability: tuple[int, int] | None = None

    @property
    def float8(self) -> bool | None:
        """Whether it has float8 matmuls (compute capability >= 8.9, as ``parallel.float8`` needs); None when
        the table cannot say (no CUDA capability)."""
        return None if self.capability is None else self.capability >= (8, 9)


# Most specific first: a name matches the first entry whose every word it contains (case-insensitive).
_KNOWN: tuple[tuple[tuple[str, ...], Device], ...] = (
    (("h100", "pcie"), Device("H100 PCIe", 80 * GIB, 756e12, (9, 0))),
    (("h100", "nvl"), Device("H100 NVL", 94 * GIB, 835e12, (9, 0))),
    (("h100",), Device("H100", 80 * GIB, 989e12, (9, 0))),
    (("h200",), Device("H200", 141 * GIB, 989e12, (9, 0))),
    (("gh200",), Device("GH200", 96 * GIB, 989e12, (9, 0))),
    (("h20",), Device("H20", 96 * GIB, 148e12, (9, 0))),
    (("b200",), Device("B200", 180 * GIB, 2250e12, (10, 0))),
    (("a100", "40g"), Device("A100 40GB", 40 * GIB, 312e12, (8, 0))),
    (("a100",), Device("A100 80GB", 80 * GIB, 312e12, (8, 0))),
    (("l40s",), Device("L40S", 48 * GIB, 362e12, (8, 9))),
    (("l4",), Device("L4", 24 * GIB, 121e12, (8, 9))),
    (("mi300x",), Device("MI300X", 192 * GIB, 1307e12)),
)


def lookup(name: str | None) -> Device | None:
    """The device whose name ``name`` is (Ray's ``accelerator_type`` such as ``H100`` or ``A100-40G``, or
    torch's ``get_device_name`` such as ``NVIDIA H100 80GB HBM3``); None when the table does not know it.
    A plain ``A100`` (Ray's type for either size) is taken as the 80 GB part unless ``40G``/``40GB`` says
    otherwise."""
    if not name:
        return None
    text = name.lower().replace("_", " ").replace("-", " ")
    words = set(text.split())
    for keys, device in _KNOWN:
        if all(any(w == k or w.startswith(k) for w in words) for k in keys):
            return device
    return None


__all__ = ["Device", "lookup"]

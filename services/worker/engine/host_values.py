"""Small host values (a step's per-row settings, row indices) on the device without waiting for it.

A blocking host-to-device copy first waits for every step queued before it on the stream, the one
the engine overlaps with included (engine.py); a pinned, non-blocking copy is queued like a kernel.
"""

from __future__ import annotations

import torch


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

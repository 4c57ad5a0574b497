"""Weights held once in a process: tensors found by their contents.

A compiled CPU decode graph's library (cpu_graph_store.py) carries its own copy of every weight it
was built with, and a float32 model has three such libraries beside the model itself: SmolLM2 held
4.25 GiB, where its weights are 0.54 GB. Most of those copies are the same bytes: the many-rows
graph multiplies with the very oneDNN packs the model's eager path does, every graph reads the same
embedding and norms, and the two few-rows graphs the same weights packed for inductor's own GEMM
kernels. A library takes a weight from here when one with its contents is already held.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable

import numpy as np
import torch


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes a tensor holds, row-major; for an opaque oneDNN tensor, its buffer as oneDNN laid it out."""
    if tensor.is_mkldnn:
        size, address = torch.ops.mkldnn._nbytes(tensor), torch.ops.mkldnn.data_ptr(tensor)
        return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(address))
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_digest(tensor: torch.Tensor) -> bytes:
    return hashlib.blake2b(tensor_bytes(tensor), digest_size=16).digest()


def _contents(tensor: torch.Tensor) -> tuple:
    """What makes two tensors interchangeable as a graph's constant: kind, type, shape, strides, bytes."""
    layout = "mkldnn" if tensor.is_mkldnn else tensor.stride()
    return layout, tensor.dtype, tuple(tensor.shape), tensor_digest(tensor)


class SharedWeights:
    """The tensors held so far, by their contents: first the model's own, then the copies taken for
    libraries that had none of theirs."""

    def __init__(self, held: Iterable[torch.Tensor]) -> None:
        self._held: dict[tuple, torch.Tensor] = {}
        for tensor in held:
            self._held.setdefault(_contents(tensor), tensor)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The held tensor with `tensor`'s contents, or else a copy of it, held from now on: PyTorch's
        copies are aligned, which the memory a library reads its weights into is not."""
        key = _contents(tensor)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = tensor.clone()
        return held

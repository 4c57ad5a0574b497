"""Weights held once in a process: the model's tensors by name, those taken for libraries by contents.

A compiled CPU decode graph's library (cpu_graph_store.py) is built with its own copy of every weight,
and a float32 model has three such libraries beside the model itself: SmolLM2 held 4.25 GiB, where
its weights are 0.54 GB. Most of those copies are the same bytes: the many-rows graph multiplies with
the very oneDNN packs the model's eager path does, every graph reads the same embedding and norms,
and the two few-rows graphs the same weights packed for inductor's own GEMM kernels. A library's
build records, for each of its weights, the model's tensor with its contents, or else a key of its
contents, so that loading it again finds what the process holds without reading or digesting a byte.
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


def form_of(tensor: torch.Tensor) -> str:
    """What two tensors must have alike, bytes aside, to stand for each other as a graph's constant:
    kind (oneDNN's opaque layout, or the strides), type and shape."""
    layout = "mkldnn" if tensor.is_mkldnn else list(tensor.stride())
    return f"{layout} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def contents_key(tensor: torch.Tensor) -> str:
    """The tensor's form and a digest of its bytes: equal keys, interchangeable constants."""
    return f"{form_of(tensor)} {tensor_digest(tensor).hex()}"


class SharedWeights:
    """The model's tensors by name, and the tensors taken for libraries so far by their contents keys."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            self.named.setdefault(name, tensor)
        self._taken: dict[str, torch.Tensor] = {}
        self._names_by_key: dict[str, str] | None = None

    def name_with(self, key: str) -> str | None:
        """The name of the model's tensor with these contents, if any. The first call digests every
        tensor of the model: a library's build asks, its loads do not."""
        if self._names_by_key is None:
            self._names_by_key = {}
            for name, tensor in self.named.items():
                self._names_by_key.setdefault(contents_key(tensor), name)
        return self._names_by_key.get(key)

    def taken(self, key: str) -> torch.Tensor | None:
        return self._taken.get(key)

    def take(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor held with this contents key, or else a copy of `tensor` (whose key it must be),
        held from now on: PyTorch's copies are aligned, which the memory a library's weights are read
        into is not."""
        held = self._taken.get(key)
        if held is None:
            held = self._taken[key] = tensor.clone()
        return held

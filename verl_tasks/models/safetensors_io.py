"""Safetensors files written in one pass: each tensor's bytes go to the file and into its sha256 together.

The commit lists every file's size and sha256. Writing with the safetensors library and hashing
afterwards reads every byte back (a SmolLM2 update: 0.5 GB of weights and 1 GB of AdamW state);
here the header is computed from the tensors' names, dtypes and shapes first, then each
tensor's bytes are written and hashed as they pass, so nothing is read back and at most one
tensor is copied at a time (a GPU tensor to the host, or an fsdp2 parameter gathered by every
rank). ``hashlib`` and file writes release the GIL on large buffers, so two files written by two
threads proceed side by side.

The layout is the format's: an 8-byte little-endian header length, the JSON header (padded with
spaces to 8 bytes), then the tensors' raw bytes in header order. The safetensors library, HF and
vLLM load it like their own.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


@dataclass(frozen=True)
class Written:
    """A file as the commit lists it."""

    size: int
    sha256: str


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor: its name, dtype and shape, in file order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for tensors written in ``specs`` order."""
    body: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors name")
        body[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape),
                           "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class HashedFile:
    """A binary file open for writing whose bytes are hashed as they are written."""

    def __init__(self, path: Path | None) -> None:
        self._handle: BinaryIO | None = open(path, "wb") if path is not None else None  # noqa: SIM115
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._digest.update(data)
        if self._handle is not None:
            self._handle.write(data)
        self.size += len(data)

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """The tensor's raw bytes, C order, from host memory (one tensor copied at most)."""
        host = tensor.detach().to("cpu").contiguous()
        if host.numel():
            self.write(host.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> Written:
        if self._handle is not None:
            self._handle.close()
        return Written(self.size, self._digest.hexdigest())


class TensorWriter:
    """Streams tensors into a safetensors file in the order their ``specs`` were given.

    ``path`` None: nothing is written, only hashed (an fsdp2 rank other than the writer takes part
    in every gather; only one rank writes).
    """

    def __init__(self, path: Path | None, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None):
        self.specs = list(specs)
        self._next = 0
        self._file = HashedFile(path)
        self._file.write(header(self.specs, metadata))

    def write(self, tensor: torch.Tensor) -> None:
        spec = self.specs[self._next]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name}: got {tensor.dtype} {tuple(tensor.shape)}, header says "
                             f"{spec.dtype} {spec.shape}")
        self._file.write_tensor(tensor)
        self._next += 1

    def close(self) -> Written:
        if self._next != len(self.specs):
            raise ValueError(f"{len(self.specs) - self._next} tensors were never written")
        return self._file.close()


def write_tensors(path: Path | None, tensors: Iterable[tuple[str, torch.Tensor]],
                  metadata: dict[str, str] | None = None) -> Written:
    """Write named tensors (in this order) as one safetensors file; returns its size and sha256."""
    named = list(tensors)
    writer = TensorWriter(path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named], metadata)
    for _name, tensor in named:
        writer.write(tensor)
    return writer.close()


def unique_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict with every tensor once: a tied weight (an LM head that is the input
    embedding) under its first name only, as Hugging Face saves it; its loader ties it again."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


__all__ = ["DTYPES", "HashedFile", "TensorSpec", "TensorWriter", "Written", "header", "unique_state",
           "write_tensors"]

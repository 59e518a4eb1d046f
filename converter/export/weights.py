"""The weights of an output directory: safetensors files, written and checked one shard at a time.

Layout (Hugging Face's): ``model.safetensors`` when everything fits in ``max_shard_size`` bytes;
otherwise ``model-00001-of-00003.safetensors`` … plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``, N the bytes of tensor data).

Every tensor is written once (tied tensors are re-tied by model.py) in the dtype it is *stored*
in: its own dtype, or under O2 the half dtype ``gm.meta["mp_param_dtypes"]`` names for it. The
writer never copies the whole model: a tensor is converted (to half, to CPU, to contiguous) only
while the shard holding it is written, and an fp32 contiguous CPU tensor is written from its own
memory (safetensors writes from the tensor's pointer).

:func:`check_weights` compares the files with the tensors they were written from, bit for bit,
reading one tensor at a time with plain reads (no mapping, so the check adds one tensor's bytes to
the process, never a shard's).
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from converter.export.errors import EmitError, VerificationError
from converter.export.notes import check

__all__ = [
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "DEFAULT_MAX_SHARD_SIZE",
    "parse_size",
    "write_weights",
    "check_weights",
    "weight_files",
    "read_header",
]

#: the single-file name; sharded output uses ``model-0000i-of-0000n.safetensors`` and the index
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: 2 GiB: a shard well under what 32-bit readers and file systems handle, and few files for 1B models
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",  # C64: safetensors >= 0.4 (FFT filters of FNO/GFNet layers)
}
_NAMED_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"500MB"`` or ``"2GiB"`` (Hugging Face's spelling)."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a number of bytes or a string like '2GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_shard_size must be a number of bytes or a string like '2GB', got {size!r}")
        value = int(float(match[1]) * _UNITS[(match[2] or "").lower()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * torch.empty((), dtype=dtype).element_size()


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as written: on the CPU, in ``dtype``, contiguous; itself when it already is."""
    out = tensor.detach()
    if out.device.type != "cpu":
        out = out.to("cpu")
    return out.to(dtype).contiguous()


def _plan(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names in order, split greedily into shards of at most ``max_shard_size`` bytes (a bigger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _untangle(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that overlap in memory; give each overlapping one its own copy
    (distinct names for one tensor are tied, and written once before this is reached)."""
    spans = sorted(
        (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), t.numel() * t.element_size(), name)
        for name, t in tensors.items() if t.numel()
    )
    end = -1
    for start, length, name in spans:
        if start < end:
            tensors[name] = tensors[name].clone()
        end = max(end, int(start + length))
    return tensors


def _umask() -> int:
    """The process umask, read without changing it where /proc says it (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_weights(tensors: Mapping[str, torch.Tensor], directory: Path, *,
                  dtypes: Optional[Mapping[str, torch.dtype]] = None,
                  max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write ``tensors`` (name -> tensor, each tensor once) into ``directory``; returns the file names.

    ``dtypes``: name -> the dtype to store that tensor in (default: its own dtype).
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    dtypes = dict(dtypes or {})
    for name, tensor in tensors.items():
        dtype = dtypes.get(name, tensor.dtype)
        if dtype not in _DTYPE_NAMES:
            raise EmitError(f"cannot write the weights: {name!r} is {dtype}, which the safetensors files of model.py do not store")
        if tensor.layout != torch.strided:
            raise EmitError(f"cannot write the weights: {name!r} is a {tensor.layout} tensor; make it dense")
    sizes = [(name, _nbytes(t, dtypes.get(name, t.dtype))) for name, t in tensors.items()]
    shards = _plan(sizes, limit)
    directory = Path(directory)
    if len(shards) == 1:
        names = [WEIGHTS_FILE]
    else:
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        part = _untangle({name: _stored(tensors[name], dtypes.get(name, tensors[name].dtype)) for name in shard})
        save_file(part, str(directory / file_name), metadata={"format": "pt"})
        os.chmod(directory / file_name, 0o666 & ~_umask())  # safetensors creates its files 0600
        del part  # the half/contiguous copies of this shard go before the next one is made
        weight_map.update(dict.fromkeys(shard, file_name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return [WEIGHTS_INDEX, *names]
    return names


# ---------------------------------------------------------------------------------------------
# reading back (for the check; model.py carries its own torch-only reader)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    stop: int


def read_header(path: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file: name -> dtype, shape, absolute byte range."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise VerificationError(f"{path.name} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise VerificationError(f"{path.name}: header length {length} exceeds the file ({size} bytes)")
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entries[name] = _Entry(_NAMED_DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end)
    return entries


def weight_files(directory: Path) -> dict[str, list[str]]:
    """file name -> the tensor names it holds, from the index when there is one."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if not index.exists():
        return {WEIGHTS_FILE: list(read_header(directory / WEIGHTS_FILE))}
    files: dict[str, list[str]] = {}
    for name, file_name in json.loads(index.read_text(encoding="utf-8"))["weight_map"].items():
        files.setdefault(file_name, []).append(name)
    return files


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs with their payloads, -0.0 vs 0.0 differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    bits = _BITS[a.element_size()]
    return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


def check_weights(tensors: Mapping[str, torch.Tensor], directory: Path, *,
                  dtypes: Optional[Mapping[str, torch.dtype]] = None) -> str:
    """The weight files in ``directory`` hold exactly ``tensors``, each in its stored dtype, bit for bit.

    One tensor is in memory at a time (read with ``readinto``, not mapped). Returns a one-line summary.
    """
    directory = Path(directory)
    dtypes = dict(dtypes or {})
    files = weight_files(directory)
    listed = [name for names in files.values() for name in names]
    if sorted(listed) != sorted(tensors):
        surplus, missing = sorted(set(listed) - set(tensors)), sorted(set(tensors) - set(listed))
        raise VerificationError(f"the weight files hold {surplus[:5]} too many and lack {missing[:5]}; please report this bug")
    total = 0
    for file_name, names in files.items():
        path = directory / file_name
        entries = read_header(path)
        if sorted(entries) != sorted(names):
            raise VerificationError(f"{file_name} does not hold the tensors the index gives it; please report this bug")
        with open(path, "rb") as f:
            for name in names:
                entry = entries[name]
                want = _stored(tensors[name], dtypes.get(name, tensors[name].dtype))
                buffer = bytearray(entry.stop - entry.start)
                f.seek(entry.start)
                if f.readinto(buffer) != len(buffer):
                    raise VerificationError(f"{file_name} is truncated at {name!r}")
                raw = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
                got = raw.view(entry.dtype).view(entry.shape)
                if not _same_bits(want, got):
                    raise VerificationError(
                        f"{file_name}: {name!r} is {tuple(got.shape)} {got.dtype} and differs from the converted model's "
                        f"{tuple(want.shape)} {want.dtype}; please report this bug"
                    )
                total += raw.numel()
                del want, raw, got, buffer
    return check(f"the weight files ({len(files)}, {total / 2**20:.1f} MiB) hold every tensor bit-exactly")

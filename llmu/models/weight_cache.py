"""The model's dequantized weights, kept on disk: loading it again takes a tenth of a second, not seconds.

Reading the GGUF file means parsing its metadata (the 49k-token vocabulary: seconds) and
dequantizing 134M Q4_1/Q8_0 values (seconds more). The result depends only on the file's bytes,
on llmu's loader (``llmu.models.loading.LOADER_VERSION``) and on the dtype, so
:func:`llmu.models.load_model` writes it once to a safetensors file in ``llmu.cache.cache_dir("models")``
(``~/.cache/llmu/models/`` unless ``LLMU_CACHE`` or ``XDG_CACHE_HOME`` says otherwise) and later maps
that file instead. The file is named after all three (the GGUF's SHA-256, the loader version, the
dtype), and says them again in its header, with the model's config and the name and shape of
every tensor.

Safety, because a learner's first load can be interrupted at any moment:

- a file is written under a temporary name in the same folder, flushed to disk (``fsync``), then
  renamed over the final name (``os.replace``, atomic): a reader sees the old file or the whole
  new one, never half of one, and two processes writing at once each write their own temporary;
- on reading, a header that does not parse, a truncated file, a tensor missing or of the wrong
  shape or dtype, or a key that does not match, makes the file unusable: llmu warns once
  (:class:`WeightCacheWarning`) and rebuilds it from the GGUF file;
- a cache folder that cannot be written (read-only, full, not a folder) costs one warning and the
  model loads without the cache.

The tensors come back memory-mapped, copy-on-write: loading reads nothing until a weight is used,
several notebooks share the file's pages, and changing a weight in place never touches the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from llmu.cache import cache_dir
from llmu.models.config import LlamaConfig

#: Sub-folder of llmu's cache folder that holds the weight files.
SUBDIR = "models"
#: A temporary file older than this is left over from a process that was killed while writing.
STALE_TEMP_S = 3600.0
_SUFFIX = ".safetensors"
_TEMP_SUFFIX = ".tmp"


class WeightCacheWarning(UserWarning):
    """The weight cache could not be used (damaged file, folder not writable); loading went on without it."""


def folder() -> Path:
    """Where weight files are kept: ``llmu.cache.cache_dir("models")``."""
    return cache_dir(SUBDIR)


@lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """SHA-256 of the file's bytes (a 100 MB GGUF: about 0.1 s), computed once per process while
    the file's size and modification time stay the same."""
    path = Path(path).resolve()
    stat = path.stat()
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cache_file(sha256: str, dtype: torch.dtype, loader_version: int) -> Path:
    """The weight file for this GGUF content, loader version and dtype (it may not exist yet):
    ``gguf-<first 16 hex digits of the SHA-256>-loader<version>-<dtype>.safetensors``. Two copies of
    one GGUF file share it; the header holds the whole SHA-256, checked on reading."""
    return folder() / f"gguf-{sha256[:16]}-loader{loader_version}-{dtype_name(dtype)}{_SUFFIX}"


def _metadata(state: dict[str, torch.Tensor], config: LlamaConfig, *, sha256: str, dtype: torch.dtype,
              loader_version: int) -> dict[str, str]:
    """What the header says besides the tensors: the key, the config, and what must be there."""
    return {
        "format": "pt",
        "llmu.loader_version": str(loader_version),
        "llmu.gguf_sha256": sha256,
        "llmu.dtype": dtype_name(dtype),
        "llmu.config": json.dumps(config.to_dict()),
        "llmu.tensors": json.dumps({name: list(t.shape) for name, t in state.items()}),
        "llmu.total_bytes": str(sum(t.numel() * t.element_size() for t in state.values())),
    }


def read(file: str | Path, *, sha256: str, dtype: torch.dtype, loader_version: int
         ) -> tuple[LlamaConfig, dict[str, torch.Tensor]] | None:
    """``(config, state)`` from a weight file, its tensors mapped on the CPU; ``None`` when there is
    no file (silently) or when it cannot be trusted (with one :class:`WeightCacheWarning`)."""
    from safetensors import safe_open

    file = Path(file)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = f.get_tensors()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error for a bad header
        warn_damaged(file, f"{type(exc).__name__}: {exc}")
        return None
    try:
        config = _check(meta, state, sha256=sha256, dtype=dtype, loader_version=loader_version)
    except (ValueError, TypeError, KeyError) as exc:
        warn_damaged(file, str(exc))
        return None
    return config, state


def _check(meta: dict, state: dict[str, torch.Tensor], *, sha256: str, dtype: torch.dtype,
           loader_version: int) -> LlamaConfig:
    """The config of a weight file whose header and tensors are what its key promises; raises otherwise."""
    wanted = {"llmu.loader_version": str(loader_version), "llmu.gguf_sha256": sha256,
              "llmu.dtype": dtype_name(dtype)}
    for key, value in wanted.items():
        if meta.get(key) != value:
            raise ValueError(f"its header says {key}={meta.get(key)!r}, expected {value!r}")
    shapes = json.loads(meta["llmu.tensors"])
    if set(shapes) != set(state):
        missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
        raise ValueError(f"tensors missing: {missing[:3]}, unexpected: {extra[:3]}")
    for name, t in state.items():
        if list(t.shape) != shapes[name] or t.dtype != dtype:
            raise ValueError(f"tensor {name} is {t.dtype} {list(t.shape)}, expected {dtype} {shapes[name]}")
    total = sum(t.numel() * t.element_size() for t in state.values())
    if str(total) != meta["llmu.total_bytes"]:
        raise ValueError(f"{total} bytes of tensors, its header says {meta['llmu.total_bytes']}")
    return LlamaConfig(**json.loads(meta["llmu.config"]))


def write(file: str | Path, state: dict[str, torch.Tensor], config: LlamaConfig, *, sha256: str,
          dtype: torch.dtype, loader_version: int) -> bool:
    """Write a weight file atomically; ``False`` (and one :class:`WeightCacheWarning`) when the folder
    cannot take it. ``state`` holds contiguous CPU tensors, each stored once (tied weights once)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    file = Path(file)
    temp = file.with_name(f".{file.name}.{os.getpid()}-{secrets.token_hex(4)}{_TEMP_SUFFIX}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(file.parent)
        save_file(state, str(temp), metadata=_metadata(state, config, sha256=sha256, dtype=dtype,
                                                       loader_version=loader_version))
        os.chmod(temp, 0o644)  # safetensors creates it private; others sharing LLMU_CACHE may read it
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the bytes are on disk before the name points at them
        finally:
            os.close(fd)
        os.replace(temp, file)
        _fsync_folder(file.parent)
    except (OSError, SafetensorError) as exc:  # safetensors reports its I/O errors as its own
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        warnings.warn(
            f"llmu could not write its weight cache {file} ({type(exc).__name__}: {exc}); the model was "
            f"loaded without it, and the next load will dequantize the GGUF file again. Point "
            f"LLMU_CACHE at a writable folder to fix this.", WeightCacheWarning, stacklevel=3)
        return False
    return True


def warn_damaged(file: Path, reason: str) -> None:
    """One warning that ``file`` cannot be used and is rebuilt from the GGUF file."""
    warnings.warn(f"llmu's weight cache {file} is damaged ({reason}); rebuilding it from the GGUF file.",
                  WeightCacheWarning, stacklevel=4)


def _fsync_folder(path: Path) -> None:
    """Flush the folder entry of a renamed file (POSIX; where a folder cannot be opened, skip it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_temps(path: Path) -> None:
    """Delete temporary files that a killed process left behind (hundreds of MB each): ours
    (``.<name>.<pid>-<random>.tmp``) and those safetensors writes before renaming (``.tmp<random>``).
    A temporary younger than :data:`STALE_TEMP_S` may be another process writing right now, and is kept."""
    now = time.time()
    for temp in [*path.glob(f".*{_SUFFIX}.*{_TEMP_SUFFIX}"), *path.glob(".tmp*")]:
        with contextlib.suppress(OSError):
            if temp.is_file() and now - temp.stat().st_mtime > STALE_TEMP_S:
                temp.unlink()

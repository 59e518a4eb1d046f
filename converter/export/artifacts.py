"""Write the output directory (docs/cli.md) atomically, and never clobber what is not ours.

::

    OUT/
      model.py       readable PyTorch code of the rewritten graph; depends only on torch
      model.safetensors  every parameter, buffer and tensor constant (above max_shard_size:
                     model-00001-of-0000N.safetensors ... and model.safetensors.index.json)
      train.py       a training loop with converter.MixedPrecisionTrainer (torchrun-ready)
      user_model.py  a copy of the model file (train.py uses its loss_fn/train_batches)
      report.json, report.md, report.html

**Weights** (:mod:`converter.export.weights`): safetensors files holding a flat ``{name: tensor}``
map. It includes non-persistent buffers and tensor constants, which ``state_dict()`` would drop but
the forward needs for bit-exact outputs. Tied parameters are stored once and re-tied by
``model.py``. Under O2 the half-stored parameters are written in half. The files are written one
shard at a time from the converted model's own tensors (no copy of the model), and model.py maps
them instead of reading them.

**Checks** (``verify``): model.py's code is run with the converted model's own tensors attached
(no second copy of the weights) and must reproduce ``conv.module`` bit for bit; the weight files
are compared with those tensors, in their stored dtype, one tensor at a time.

**Publishing**: everything is written to a hidden temporary sibling ``.OUT.tmp-PID-XXXXXXXX`` and
renamed into place at the end.

- Without ``force`` the rename never replaces anything: ``renameat2(RENAME_NOREPLACE)`` on Linux;
  elsewhere (or on a file system without it) a plain rename, which fails onto a non-empty
  directory, so at worst an empty directory that appeared meanwhile is replaced. Output that
  appeared at OUT after the first check is left as it is, and :class:`OutputExistsError` is raised.
- With ``force`` an existing directory is replaced only when it is a previous mpconvert output that
  holds nothing else (:func:`foreign_contents`): every output carries a marker,
  ``.mpconvert-output.json``, listing each file it wrote with its size and modification time, so a
  folder we did not write, a file added to ours (a trained checkpoint, a ``data/`` folder) or one
  edited since, and a folder holding the model being converted (``inputs``) are refused with
  :class:`OutputExistsError` naming what would be lost. The replacement is swapped atomically with
  ``renameat2(RENAME_EXCHANGE)`` (OUT always exists, old or new); the swapped-out directory is
  checked again and swapped back when something not ours appeared there meanwhile. Without that
  call it is moved aside (checked likewise), the new one renamed into place and the old one deleted.
- Any exception, ``KeyboardInterrupt`` included, removes the temporary directory and the parent
  directories this call created. A death no Python code sees (a library's ``exit(1)`` out of memory,
  SIGKILL) is seen by a watcher process (:mod:`converter.export.watchdog`), which removes the
  temporary directory and says so. Temporary directories left by killed runs (their PID is no longer
  running) are removed by the next run to the same OUT.
- A failed write of model.onnx (a file-size limit, a full disk) fails the whole publication (the
  CLI's exit 2, the old output kept); model.onnx itself is written to a temporary name and renamed.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

from converter.export.errors import EmitError, OutputExistsError
from converter.export.model_py import generate_model_source
from converter.export.notes import warning
from converter.export.train_py import (
    USER_MODEL_FILE,
    model_file_to_copy,
    render_train_py,
)
from converter.export.verify import verify_emitted
from converter.export.watchdog import guarded
from converter.export.weights import DEFAULT_MAX_SHARD_SIZE, check_weights, parse_size, write_weights
from converter.vocab import DEVICES

__all__ = ["emit", "emit_reports", "publish_directory", "check_output_dir", "clean_stale_temporaries", "foreign_contents",
           "MARKER"]

#: the file every output directory carries: what mpconvert wrote there (``--force`` replaces only that)
MARKER = ".mpconvert-output.json"

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


# ---------------------------------------------------------------------------------------------
# renames that do not replace


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the system or file system does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _appeared(out_dir: Path) -> OutputExistsError:
    return OutputExistsError(
        f"{out_dir} appeared while this run was converting (another run?); it was left as it is and nothing "
        "was written; pass --force to replace it or choose another --out"
    )


def _rename_new(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, which must not exist; :class:`OutputExistsError` otherwise."""
    try:
        if _renameat2(tmp, out_dir, _RENAME_NOREPLACE):
            return
        if os.path.lexists(out_dir):
            raise _appeared(out_dir)
        os.rename(tmp, out_dir)  # fails onto a file or a non-empty directory: nothing is lost
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
        raise _appeared(out_dir) from exc
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise _appeared(out_dir) from exc
        raise


def _replace(tmp: Path, out_dir: Path, parent: Path) -> None:
    """Put ``tmp`` at ``out_dir``, replacing the directory there (``force``)."""
    if not os.path.lexists(out_dir):
        with contextlib.suppress(OutputExistsError):
            _rename_new(tmp, out_dir)
            return
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a directory; choose another --out")
    if _renameat2(tmp, out_dir, _RENAME_EXCHANGE):
        # ``tmp`` now holds the old directory: delete it only if it is still ours alone
        why = _not_ours(tmp, out_dir)
        if why is not None:
            _renameat2(tmp, out_dir, _RENAME_EXCHANGE)  # swap back: theirs stays where it was
            raise OutputExistsError(why)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(out_dir, old)
    why = _not_ours(old, out_dir)
    if why is not None:
        os.replace(old, out_dir)
        raise OutputExistsError(why)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# temporary directories


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or we cannot tell: keep its files
    return True


def clean_stale_temporaries(out_dir: Path) -> list[Path]:
    """Remove ``.OUT.tmp-PID-*``/``.OUT.old-PID-*`` siblings of ``out_dir`` whose process is gone."""
    out_dir = Path(out_dir)
    parent = out_dir.absolute().parent
    removed: list[Path] = []
    if os.name != "posix" or not parent.is_dir():
        return removed
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or match["name"] != out_dir.name or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _running(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def _uninterruptible():
    """Hold off SIGINT while cleaning up or swapping directories (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------
# publishing


def _listing(directory: Path) -> dict[str, Optional[list[int]]]:
    """``{relative path: [size, mtime_ns]}`` for the files under ``directory`` (None for folders and links)."""
    found: dict[str, Optional[list[int]]] = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            st = path.lstat()
            found[rel] = [st.st_size, st.st_mtime_ns] if path.is_file() and not path.is_symlink() else None
    return found


def _write_marker(directory: Path) -> None:
    """Record what was written into ``directory`` (the last file written; it does not list itself)."""
    from converter._version import __version__

    listing = _listing(directory)
    text = json.dumps({"mpconvert": __version__, "files": listing}, indent=1, sort_keys=True)
    (directory / MARKER).write_text(text + "\n", encoding="utf-8")


def foreign_contents(out_dir: Path) -> Optional[list[str]]:
    """What in ``out_dir`` mpconvert did not write: None when it is not an mpconvert output at all
    (no readable marker), else the paths added or changed since it was written (empty: all ours)."""
    marker = Path(out_dir) / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 64 << 20:
            return None
        recorded = json.loads(marker.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    if not isinstance(recorded, dict):
        return None
    present = _listing(Path(out_dir))
    present.pop(MARKER, None)
    changed = []
    for rel, stat in sorted(present.items()):
        if rel not in recorded or (stat is not None and recorded[rel] != stat):
            changed.append(rel)
        elif stat is None and recorded[rel] is not None:  # a file we wrote is now a link or a folder: the user's
            changed.append(rel)
    return changed


def _not_ours(directory: Path, shown_as: Path) -> Optional[str]:
    """Why ``directory`` (shown to the user as ``shown_as``) must not be deleted by ``--force`` (None: it may)."""
    foreign = foreign_contents(directory)
    if foreign is None:
        return (f"--force replaces only a previous mpconvert output, and {shown_as} is not one (it has no {MARKER}); "
                "nothing was deleted: choose another --out, or move that folder away yourself")
    if foreign:
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (f"--force would delete {names} in {shown_as}, which mpconvert did not write (or which changed since); "
                "nothing was deleted: move them away or choose another --out")
    return None


def check_output_dir(out_dir: Path, *, force: bool, inputs: Iterable[Union[str, Path]] = ()) -> None:
    """Raise :class:`OutputExistsError` when ``out_dir`` exists and may not be replaced.

    Without ``force`` any existing ``out_dir`` is refused. With it, only a previous mpconvert output
    holding nothing but what it wrote (:func:`foreign_contents`) may be replaced, and never a folder
    that holds (or is) one of ``inputs``: the model file or checkpoint folder being converted, rule
    files, calibration data.
    """
    out_dir = Path(out_dir)
    if not os.path.lexists(out_dir):
        return
    if not force:
        raise OutputExistsError(f"output directory {out_dir} already exists; pass --force to replace it or choose another --out")
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a directory; choose another --out")
    here = out_dir.resolve()
    for item in inputs:
        path = Path(os.path.abspath(item))
        if os.path.lexists(path) and (path.resolve() == here or here in path.resolve().parents):
            raise OutputExistsError(f"--force would delete {item}, an input of this run ({out_dir} is or holds it); "
                                    "nothing was deleted: choose another --out")
    why = _not_ours(out_dir, out_dir)
    if why is not None:
        raise OutputExistsError(why)


def publish_directory(out_dir: Path, fill: Callable[[Path], Any], *, force: bool = False) -> Path:
    """Create a temporary sibling of ``out_dir``, let ``fill`` write into it, then rename it into place.

    Without ``force`` nothing at ``out_dir`` is ever replaced: output that appears there while
    ``fill`` runs makes this raise :class:`OutputExistsError`. Any exception (``KeyboardInterrupt``
    included) removes the temporary directory and the parent directories this call created.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    parent = out_dir.absolute().parent
    created: list[Path] = []
    probe = parent
    while not probe.exists():
        created.append(probe)
        probe = probe.parent
    clean_stale_temporaries(out_dir)
    tmp = parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with guarded(tmp, out_dir):  # a death Python never sees (OpenBLAS's exit(1) out of memory) leaves no tmp
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            fill(tmp)
            _write_marker(tmp)
            with _uninterruptible():
                if force:
                    _replace(tmp, out_dir, parent)
                else:
                    _rename_new(tmp, out_dir)
        except BaseException:
            with _uninterruptible():
                shutil.rmtree(tmp, ignore_errors=True)
                for directory in created:
                    with contextlib.suppress(OSError):
                        directory.rmdir()
            raise
    return out_dir


def _write_reports(report, directory: Path) -> list[str]:
    from converter.report.render import write_reports

    write_reports(report, directory)
    return []


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def emit(
    conv,
    out_dir: Path,
    *,
    force: bool = False,
    model_file: Optional[str] = None,
    device: str = "cpu",
    verify: bool = True,
    extra: Optional[Callable[[Path], Any]] = None,
    messages: Optional[list] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write model.py, the weights, train.py (with a copy of the model file) and the reports atomically.

    ``model_file``: the model file the conversion came from; it is copied next to train.py as
    ``user_model.py`` (train.py imports its ``loss_fn`` and ``train_batches`` from there).
    ``device``: where the emitted model is checked (``cuda`` needs CUDA). ``verify``: check that
    model.py reproduces ``conv.module`` before publishing. ``extra``: called with the temporary
    directory before it is published (the CLI exports ONNX there), so its files are part of the
    atomic output. ``messages``: a list that receives warnings and check results, each an
    :class:`~converter.export.notes.EmitNote` (a ``str`` whose ``kind`` says which).
    ``max_shard_size``: bytes (or ``"500MB"``, ``"2GiB"``) above which the weights are split into
    several safetensors files with an index. Returns the output directory.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise EmitError(f"unknown device {device!r}; use cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise EmitError("--device cuda was given but CUDA is not available on this machine; use --device cpu")
    notes = messages if messages is not None else []
    shard_size = parse_size(max_shard_size)
    if getattr(conv, "partition", None) is not None:  # converted region by region: user code + region graphs
        return _emit_partial(conv, out_dir, force=force, model_file=model_file, verify=verify, extra=extra, notes=notes,
                             max_shard_size=shard_size)
    source = generate_model_source(conv, model_file=model_file)
    notes.extend(warning(text) for text in source.warnings)
    train_py = render_train_py(conv, model_file=model_file)
    user_model = model_file_to_copy(model_file)

    own = source.own
    if source.external:  # converted on the meta device: the weights come from the user's checkpoint
        notes.append(warning(f"model.py takes {len(source.external)} tensors from a checkpoint of yours: "
                             "model.load(weights='FOLDER_OR_FILE.safetensors') (the model was converted without its "
                             "weights, on the meta device, so model.py was not run here)"))

    def fill(tmp: Path) -> None:
        _write_text(tmp / "model.py", source.code)
        if own:
            write_weights(own, tmp, dtypes=source.dtypes, max_shard_size=shard_size)
        _write_text(tmp / "train.py", train_py)
        if user_model is not None:
            shutil.copyfile(user_model, tmp / USER_MODEL_FILE)
        notes.extend(_write_reports(conv.report, tmp))
        if verify and own:
            notes.append(check_weights(own, tmp, dtypes=source.dtypes))
        if verify and not source.external:
            notes.append(verify_emitted(conv, tmp, device="cpu", tensors=source.tensors))
            if str(device).startswith("cuda"):
                notes.append(verify_emitted(conv, tmp, device=device, tensors=source.tensors))
        if extra is not None:
            extra(tmp)

    return publish_directory(out_dir, fill, force=force)


def _emit_partial(conv, out_dir: Path, *, force: bool, model_file: Optional[str], verify: bool,
                  extra: Optional[Callable[[Path], Any]], notes: list, max_shard_size: int) -> Path:
    """:func:`emit` for a model converted region by region (:mod:`converter.export.partial_py`)."""
    from converter.export.partial_py import generate_partial_source, verify_partial, write_partial

    made = generate_partial_source(conv, model_file=model_file)
    notes.extend(made.warnings)
    train_py = render_train_py(conv, model_file=str(made.model_file))

    def fill(tmp: Path) -> None:
        write_partial(tmp, made, max_shard_size=max_shard_size)
        _write_text(tmp / "train.py", train_py)
        notes.extend(_write_reports(conv.report, tmp))
        if verify:
            notes.append(verify_partial(conv, tmp))
        if extra is not None:
            extra(tmp)

    return publish_directory(out_dir, fill, force=force)


def emit_reports(report, out_dir: Path, *, force: bool = False, messages: Optional[list] = None) -> Path:
    """Write report.json/.md/.html (the audit) into ``out_dir`` atomically, like :func:`emit`."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    notes = messages if messages is not None else []
    return publish_directory(out_dir, lambda tmp: notes.extend(_write_reports(report, tmp)), force=force)

"""model.py's torch-only safetensors reader refuses what the safetensors library refuses (issue 31 item 5).

On the old code the reader accepted overlapping byte ranges (two Parameters sharing memory), gaps,
trailing bytes and UTF-16/BOM headers, read headers of any size (a 300 MiB header: 7.7 s, 985 MB),
and hung on a FIFO named model.safetensors. Each crafted file is given to both readers: ours must
raise exactly when ``safetensors.torch.load_file`` does.
"""
from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import converter
from converter.export.emit import emit
from converter.export.verify import import_file
from tests.helpers import SAMPLES


@pytest.fixture(scope="module")
def model_py(tmp_path_factory):
    from converter.cli.modelfile import load_model_file

    mf = load_model_file(SAMPLES / "mlp.py")
    conv = converter.convert(mf.model, mf.example_inputs, precision="bf16")
    out = emit(conv, tmp_path_factory.mktemp("strict") / "o")
    return import_file(out / "model.py"), out


def _raw(path, header: bytes, data: bytes, *, length: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length))
        f.write(header)
        f.write(data)


def _header(**tensors) -> bytes:
    return json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": offsets}
                       for name, (shape, offsets) in tensors.items()}).encode()


_DATA = torch.arange(4, dtype=torch.float32).numpy().tobytes()  # 16 bytes


CASES = {
    "good": lambda p: _raw(p, _header(a=([2], [0, 8]), b=([2], [8, 16])), _DATA),
    "overlap": lambda p: _raw(p, _header(a=([2], [0, 8]), b=([2], [4, 12]), c=([1], [12, 16])), _DATA),
    "gap": lambda p: _raw(p, _header(a=([2], [0, 8]), b=([1], [12, 16])), _DATA),
    "trailing": lambda p: _raw(p, _header(a=([2], [0, 8]), b=([1], [8, 12])), _DATA),
    "bom": lambda p: _raw(p, b"\xef\xbb\xbf" + _header(a=([4], [0, 16])), _DATA),
    "utf16": lambda p: _raw(p, _header(a=([4], [0, 16])).decode().encode("utf-16"), _DATA),
    "not-object": lambda p: _raw(p, b"[1, 2]", _DATA),
    "float-offsets": lambda p: _raw(p, json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}}).encode(),
                                    _DATA),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_reader_refuses_exactly_what_safetensors_refuses(model_py, tmp_path, case):
    module, _ = model_py
    path = tmp_path / "w.safetensors"
    CASES[case](path)
    try:
        theirs = load_file(str(path))
    except Exception as exc:  # the library's verdict, compared below (not an assertion)
        theirs = exc
    library_refuses = isinstance(theirs, Exception)
    if library_refuses:
        with pytest.raises(ValueError, match=str(path)):
            module._read_safetensors(str(path))
    else:
        ours = module._read_safetensors(str(path))
        assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert library_refuses == (case != "good"), (case, theirs)


def test_a_header_over_100_mb_is_refused_unread(model_py, tmp_path):
    module, _ = model_py
    path = tmp_path / "huge.safetensors"
    length = 150_000_000
    with open(path, "wb") as f:  # a sparse file: the header is never written, nor read
        f.write(struct.pack("<Q", length))
        f.truncate(8 + length + 16)
    with pytest.raises(ValueError, match="at most 100000000 bytes"):
        module._read_safetensors(str(path))
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="HeaderTooLarge|header"):
        load_file(str(path))


def test_a_fifo_is_refused_without_hanging(model_py, tmp_path):
    module, out = model_py
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    outcome = {}

    def read():
        try:
            module.load(weights=str(fifo))
        except Exception as exc:  # recorded for the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # unblock the reader so the test run can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("load(weights=FIFO) hung")
    assert "is not a regular file" in str(outcome.get("error")), outcome


def test_our_own_weights_and_safetensors_files_still_load(model_py, tmp_path):
    module, out = model_py
    model = module.load()
    ref = load_file(str(out / "model.safetensors"))
    ours = module._read_safetensors(str(out / "model.safetensors"))
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)
    path = tmp_path / "lib.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    again = module._read_safetensors(str(path))
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())

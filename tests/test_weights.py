"""The weight files of an output directory (issue 23, "Output that scales").

* safetensors, sharded with Hugging Face's index above ``max_shard_size``; tied tensors once;
* model.py's torch-only reader agrees bit for bit with ``safetensors.torch.load_file``, maps the
  file (RSS does not grow by its size) copy-on-write, and copies only a misaligned tensor;
* O2 stores the half parameters in half: exactly half the bytes of O1 for an all-linear model,
  and the loaded model is still bit-identical to ``conv.module`` and trains with master weights;
* saving copies no weights: the tensors written and checked are ``conv.module``'s own.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import converter
from converter.export.emit import emit, generate_model_source, import_file
from converter.export.errors import VerificationError
from converter.export.verify import verify_emitted
from converter.export.weights import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    check_weights,
    parse_size,
    write_weights,
)


def _linear_stack(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias), nn.ReLU(),
                         nn.Linear(32, 8, bias=bias))


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """An emitted model.py (its module), for its torch-only safetensors reader."""
    out = emit(converter.convert(_linear_stack(), (X,), precision="bf16"), tmp_path_factory.mktemp("r") / "o")
    return import_file(out / "model.py")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or not a.dtype.is_floating_point:
        return torch.equal(a, b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


def _mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    f32 = torch.randn(7, 5, generator=gen)
    f32[0, 0] = float("nan")
    f32[0, 1] = -0.0
    return {
        "f32": f32,
        "bf16": torch.randn(3, 9, generator=gen).bfloat16(),
        "f16": torch.randn(11, generator=gen).half(),
        "i64": torch.randint(-2**40, 2**40, (5, 3), generator=gen),
        "bool": torch.rand(13, generator=gen) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "u8": torch.randint(0, 255, (5,), generator=gen, dtype=torch.uint8),
    }


def test_reader_agrees_with_safetensors_bit_for_bit(reader, tmp_path):
    tensors = _mixed_tensors()
    assert write_weights(tensors, tmp_path) == [WEIGHTS_FILE]
    ours = reader._read_safetensors(str(tmp_path / WEIGHTS_FILE))
    theirs = load_file(tmp_path / WEIGHTS_FILE)
    assert sorted(ours) == sorted(theirs) == sorted(tensors)
    for name, tensor in tensors.items():
        assert _bits_equal(ours[name], theirs[name]), name
        assert _bits_equal(ours[name], tensor), name
    size = (tmp_path / WEIGHTS_FILE).stat().st_size
    # safetensors' writer aligns every tensor for its dtype: each one is a view of the mapped file, none a copy
    assert all(t.untyped_storage().nbytes() == size for t in ours.values())


def test_sharded_files_index_and_reader(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))  # 3 x (16384 + 256) bytes fp32
    conv = converter.convert(model, (torch.randn(2, 64),), precision="bf16")
    out = emit(conv, tmp_path / "o", max_shard_size=20_000)
    files = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files == sorted([*shards, WEIGHTS_INDEX])
    index = json.loads((out / WEIGHTS_INDEX).read_text())
    assert index["metadata"] == {"total_size": 3 * (64 * 64 + 64) * 4}
    assert index["weight_map"] == {f"{i}.{k}": shards[i] for i in range(3) for k in ("weight", "bias")}
    module = import_file(out / "model.py")
    ours = module._read_weights()
    theirs = {k: v for shard in shards for k, v in load_file(out / shard).items()}
    assert sorted(ours) == sorted(theirs) == sorted(index["weight_map"])
    for name in ours:
        assert _bits_equal(ours[name], theirs[name]), name
    with torch.no_grad():
        assert torch.equal(module.load()(torch.ones(2, 64)), conv.module(torch.ones(2, 64)))


def test_shard_size_strings():
    assert parse_size(123) == 123 and parse_size("2GiB") == 2 * 1024**3 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5kb") == 1500
    for bad in ("", "2 parsecs", 0, -1, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_misaligned_tensor_is_copied(reader, tmp_path):
    """A writer other than safetensors' own may leave a tensor at an offset its dtype cannot view."""
    values = torch.tensor([1.5, -2.25, 3.0])
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes([7]) + values.numpy().tobytes())
    got = reader._read_safetensors(str(path))
    assert torch.equal(got["a"], torch.tensor([7], dtype=torch.uint8))
    assert _bits_equal(got["b"], values)
    assert got["b"].untyped_storage().nbytes() == 12  # its own copy, not the mapping
    assert got["a"].untyped_storage().nbytes() == path.stat().st_size


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_reader_maps_copy_on_write(reader, tmp_path):
    big = {"w": torch.ones(64, 1024, 1024, dtype=torch.uint8)}  # 64 MiB
    write_weights(big, tmp_path)
    del big
    before = _rss_mib()
    got = reader._read_safetensors(str(tmp_path / WEIGHTS_FILE))["w"]
    grown = _rss_mib() - before
    assert grown < 8, f"reading a 64 MiB file grew RSS by {grown:.1f} MiB: it was read, not mapped"
    got[0, 0, :4] = 9  # writeable: a private copy of that page
    assert load_file(tmp_path / WEIGHTS_FILE)["w"][0, 0, :4].tolist() == [1, 1, 1, 1]  # the file is unchanged


# ---------------------------------------------------------------------------------------------
# O2: half storage


def _data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - length


@pytest.mark.parametrize("bias", [False, True])
def test_o2_weights_are_half_the_size_and_bit_exact(tmp_path, bias):
    model = _linear_stack(bias)
    numel = sum(p.numel() for p in model.parameters())
    sizes = {}
    for level in ("O1", "O2"):
        conv = converter.convert(model, (X,), precision="bf16", opt_level=level)
        out = emit(conv, tmp_path / level)
        sizes[level] = _data_bytes(out / WEIGHTS_FILE)
        module = import_file(out / "model.py")
        loaded = module.load()
        want = torch.bfloat16 if level == "O2" else torch.float32
        assert {n: p.dtype for n, p in loaded.named_parameters()} == dict.fromkeys(dict(model.named_parameters()), want)
        assert module.OPT_LEVEL == level
        size = (out / WEIGHTS_FILE).stat().st_size
        assert all(p.untyped_storage().nbytes() == size for p in loaded.parameters())  # load() maps, copies nothing
        assert all(dtype == want for _, (_, dtype, _) in module.PARAMETERS.items())
        with torch.no_grad():
            ref = conv.module(X)
            got = loaded(X)
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert sizes == {"O1": numel * 4, "O2": numel * 2}


def test_o2_model_trains_with_master_weights(tmp_path):
    conv = converter.convert(_linear_stack(), (X,), precision="bf16", opt_level="O2")
    out = emit(conv, tmp_path / "o")
    model = import_file(out / "model.py").load()
    model.train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = converter.MixedPrecisionTrainer(model, optimizer, precision="bf16", master_weights=True)
    masters = trainer.master_params
    assert len(masters) == len(start) and all(m.dtype == torch.float32 for m in masters)
    for _ in range(2):
        trainer.zero_grad()
        trainer.backward(model(X).float().pow(2).mean())
        assert trainer.step()
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and not torch.equal(param, start[name]), name
    reread = load_file(out / WEIGHTS_FILE)  # training wrote the private mapping, never the file
    assert all(torch.equal(reread[n], start[n]) for n in start)


def test_train_py_trains_o2_storage_with_master_weights(tmp_path, capsys):
    conv = converter.convert(_linear_stack(), (X,), precision="bf16", opt_level="O2")
    out = emit(conv, tmp_path / "o")
    train = import_file(out / "train.py")
    assert train.main(["--steps", "2", "--device", "cpu"]) == 0
    stdout = capsys.readouterr().out
    assert "stored in half" in stdout and "in bf16 (O2)" in stdout, stdout


# ---------------------------------------------------------------------------------------------
# saving copies nothing; the checks fail when they should


def test_save_writes_and_checks_the_models_own_tensors(tmp_path):
    conv = converter.convert(_linear_stack(), (X,), precision="bf16")
    source = generate_model_source(conv)
    params = dict(conv.module.named_parameters())
    assert sorted(source.tensors) == sorted(params)
    for name, tensor in source.tensors.items():
        assert tensor.data_ptr() == params[name].data_ptr(), name  # not a copy
    out = emit(conv, tmp_path / "o")
    module = import_file(out / "model.py")
    built = module._build(dict(source.tensors), stored=False)
    for name, param in built.named_parameters():
        assert param.data_ptr() == params[name].data_ptr() and param.requires_grad, name
    assert "bit-exactly" in verify_emitted(conv, out, tensors=source.tensors)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.scale)


def test_non_persistent_buffers_and_frozen_flags_survive(tmp_path):
    """(Tied tensors written once: tests/test_emit.py, GPT-2's lm_head.weight.)"""
    torch.manual_seed(0)
    model = _Scaled()
    model.a.weight.requires_grad_(False)
    x = torch.randn(2, 8)
    conv = converter.convert(model, (x,), precision="bf16")
    out = emit(conv, tmp_path / "o")
    assert sorted(load_file(out / WEIGHTS_FILE)) == ["a.weight", "b.bias", "b.weight", "scale"]
    loaded = import_file(out / "model.py").load()
    assert not loaded.a.weight.requires_grad and loaded.b.weight.requires_grad
    assert "scale" not in loaded.state_dict() and torch.equal(loaded.scale, model.scale)
    with torch.no_grad():
        assert torch.equal(loaded(x), conv.module(x))


def test_check_weights_finds_one_flipped_bit(tmp_path):
    tensors = {"a": torch.randn(4, 4), "b": torch.arange(6)}
    write_weights(tensors, tmp_path)
    assert "bit-exactly" in check_weights(tensors, tmp_path)
    path = tmp_path / WEIGHTS_FILE
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(VerificationError, match="differs from the converted model"):
        check_weights(tensors, tmp_path)
    save_file({"a": tensors["a"]}, path)
    with pytest.raises(VerificationError, match=r"lack \['b'\]"):
        check_weights(tensors, tmp_path)


def test_cli_max_shard_size(tmp_path, capfd):
    from converter.cli.main import main
    from tests.helpers import SAMPLES

    out = tmp_path / "o"
    assert main([str(SAMPLES / "mlp.py"), "--out", str(out), "-q", "--max-shard-size", "10kB"]) == 0
    index = json.loads((out / WEIGHTS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # fc2.weight (16 KiB) alone in one
    assert all((out / f).stat().st_mode & 0o777 == (out / "model.py").stat().st_mode & 0o777 for f in files)
    assert main([str(SAMPLES / "mlp.py"), "--out", str(tmp_path / "p"), "-q", "--max-shard-size", "lots"]) == 2
    assert "not a size" in capfd.readouterr().err

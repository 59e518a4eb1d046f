"""The emitted output directory: standalone model.py (bit-exact), weights, train.py, atomic writes.

One conversion per sample (module-scoped). Subprocesses only where a real process is the point:
the standalone load (``converter`` must not be importable), ``train.py``, and SIGINT.
"""
from __future__ import annotations

import ast
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import converter
from converter.export import artifacts as artifacts_mod
from converter.export.emit import (
    EmitError,
    OutputExistsError,
    emit,
    generate_model_source,
    import_file,
)
from converter.export.weights import write_weights
from tests.helpers import ROOT, SAMPLES, load_sample

STDLIB_OK = {"os", "json", "math", "stat", "time", "typing", "warnings", "operator", "builtins", "torch"}


def _convert(name: str, **kwargs):
    sample = load_sample(name)
    model = sample.build_model()
    example = sample.example_inputs()
    return converter.convert(model, example, **kwargs)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """sample name -> (conversion, output dir) for the fx and export samples."""
    base = tmp_path_factory.mktemp("emitted")
    result = {}
    for name in ("mlp", "cnn", "tiny_transformer", "hf_gpt2"):
        conv = _convert(name)
        out = emit(conv, base / f"{name}_mp", model_file=str(SAMPLES / f"{name}.py"))
        result[name] = (conv, out)
    # converted for CPU: attention lowered to matmul/softmax/matmul nodes (converter.lower)
    conv = _convert("tiny_transformer", device="cpu")
    assert conv.report.to_dict()["lowered"], "the CPU conversion lowered no attention"
    result["tiny_transformer_cpu"] = (conv, emit(conv, base / "tiny_transformer_cpu_mp",
                                                 model_file=str(SAMPLES / "tiny_transformer.py")))
    return result


def _reference(conv):
    """conv.module's outputs on its example inputs, without touching its buffers."""
    module = copy.deepcopy(conv.module)
    args, kwargs = conv.example_inputs
    with torch.no_grad():
        return module(*args, **kwargs)


def _main_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"]


# ---------------------------------------------------------------------------------------------
# standalone load


_STANDALONE = textwrap.dedent(
    """
    import importlib.util, sys
    # -I keeps the repo off sys.path; where mpconvert is installed (CI installs it into the venv that
    # also holds torch) the package is blocked outright: any import of it now fails.
    if importlib.util.find_spec("converter") is not None:
        sys.modules["converter"] = None
    sys.modules["safetensors"] = None  # model.py reads its weights with torch alone
    import torch
    assert importlib.util.find_spec("converter") is None, "converter must not be importable here"
    try:
        import converter  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("converter imported")
    jobs = torch.load(sys.argv[1], weights_only=True)
    results = {}
    for name, (model_py, args, kwargs) in jobs.items():
        spec = importlib.util.spec_from_file_location("emitted_" + name, model_py)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.load()
        with torch.no_grad():
            out = model(*args, **kwargs)
        results[name] = out if isinstance(out, torch.Tensor) else out["logits"]
        results[name + ".modules"] = sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in ("converter", "transformers"))
    torch.save(results, sys.argv[2])
    """
)


def test_standalone_load_is_bit_exact_without_converter(outputs, tmp_path):
    jobs = {}
    for name, (conv, out) in outputs.items():
        args, kwargs = conv.example_inputs
        jobs[name] = (str(out / "model.py"), args, kwargs)
    torch.save(jobs, tmp_path / "jobs.pt")
    script = tmp_path / "standalone.py"
    script.write_text(_STANDALONE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(tmp_path / "jobs.pt"), str(tmp_path / "results.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    for name, (conv, _out) in outputs.items():
        ref = _main_tensor(_reference(conv))
        got = results[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got, ref), f"{name}: max |diff| {(got.double() - ref.double()).abs().max().item()}"
        assert results[name + ".modules"] == [], f"{name} imported {results[name + '.modules']}"


def test_model_py_is_readable_torch_only_code(outputs):
    for name, (_conv, out) in outputs.items():
        code = (out / "model.py").read_text()
        tree = ast.parse(code)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        assert imported <= STDLIB_OK, (name, imported)
        assert "def load(device=\"cpu\", weights=None)" in code  # the contract's signature, plus an optional checkpoint
        assert f".to(torch.{'bfloat16'})" in code  # explicit casts
        assert "torch.from_file(path, shared=False" in code and "torch.load" not in code and "pickle" not in code
        assert "converter" not in imported and "import converter" not in code
    tt = (outputs["tiny_transformer"][1] / "model.py").read_text()
    assert "'layers.0.attn.qkv.weight'" in tt  # original parameter names
    assert "# --- layers.0.attn.qkv (Linear)" in tt  # module comments
    cnn = (outputs["cnn"][1] / "model.py").read_text()
    assert "nn.BatchNorm2d(16, eps=1e-05, momentum=0.1" in cnn
    assert "nn.MaxPool2d(kernel_size=2" in cnn
    gpt2 = (outputs["hf_gpt2"][1] / "model.py").read_text()
    assert "def forward(self, input_ids):" in gpt2
    assert "return {'logits':" in gpt2
    assert "_guards_fn" not in gpt2 and "pytree" not in gpt2
    assert "'lm_head.weight': ('transformer.wte.weight', 'parameter')" in gpt2  # tied weights re-tied


def test_loaded_model_structure_and_weights(outputs):
    conv, out = outputs["hf_gpt2"]
    module = import_file(out / "model.py")
    model = module.load()
    names = dict(model.named_parameters())
    assert set(names) == set(dict(conv.module.named_parameters()))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.meta["mp_param_dtypes"] == {k: v for k, v in conv.module.meta["mp_param_dtypes"].items() if k in names}
    state = load_file(out / "model.safetensors")
    assert set(state) == set(dict(conv.module.named_parameters())) | set(dict(conv.module.named_buffers()))
    conv_cnn, out_cnn = outputs["cnn"]
    cnn = import_file(out_cnn / "model.py").load()
    assert isinstance(cnn.b1.bn, nn.BatchNorm2d) and cnn.training == conv_cnn.module.training
    for key, value in conv_cnn.module.state_dict().items():
        assert torch.equal(cnn.state_dict()[key], value), key


def test_reports_written(outputs):
    conv, out = outputs["mlp"]
    data = json.loads((out / "report.json").read_text())
    assert data["summary"] == json.loads(json.dumps(conv.report.summary, default=str))
    for name in ("report.md", "report.html"):
        assert (out / name).is_file()


# ---------------------------------------------------------------------------------------------
# train.py


def _train_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return env


_NO_TRAINING = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, ids):
        return self.drop(self.fc(x)).sum(-1) + ids.float()


def build_model():
    torch.manual_seed(0)
    return Tiny()


def example_inputs():
    return (torch.randn(4, 8), torch.randint(0, 5, (4,)))
'''


@pytest.fixture(scope="module")
def train_runs(outputs, tmp_path_factory):
    """``train.py --steps 5`` for mlp (loss_fn/train_batches) and for a model file without them (O2),
    run concurrently: name -> CompletedProcess."""
    from converter.cli.modelfile import load_model_file

    base = tmp_path_factory.mktemp("train")
    model_file = base / "notrain.py"
    model_file.write_text(_NO_TRAINING)
    mf = load_model_file(model_file)
    out = emit(converter.convert(mf.model, mf.example_inputs), base / "notrain_mp", model_file=str(model_file))
    commands = {
        "mlp": [sys.executable, str(outputs["mlp"][1] / "train.py"), "--steps", "5"],
        "notrain": [sys.executable, str(out / "train.py"), "--steps", "5", "--o2"],
    }
    procs = {name: subprocess.Popen(cmd, cwd=base, env=_train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(commands[name], proc.returncode, stdout, stderr)
    return results


def _steps(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def test_train_py_with_loss_fn_and_train_batches(train_runs):
    proc = train_runs["mlp"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(proc.stdout)
    assert len(steps) == 5
    assert all("loss" in s and "scale" in s and "skipped" in s for s in steps)
    assert "NOTICE" not in proc.stdout
    assert "train_batches()/loss_fn from" in proc.stdout


def test_train_py_without_loss_fn_uses_synthetic_data(train_runs):
    proc = train_runs["notrain"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NOTICE:" in proc.stdout and "SYNTHETIC" in proc.stdout
    assert "notrain.py defines no loss_fn or train_batches" in proc.stdout
    assert "(O2)" in proc.stdout
    assert len(_steps(proc.stdout)) == 5


# ---------------------------------------------------------------------------------------------
# atomic output


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def test_existing_dir_refused_then_replaced_with_force(outputs, tmp_path):
    conv, _ = outputs["mlp"]
    out = tmp_path / "o"
    emit(conv, out)
    (out / "model.py").write_text("# stale\n")
    old_stat = (out / "model.py").stat()
    with pytest.raises(OutputExistsError, match="--force"):
        emit(conv, out)
    # --force replaces a previous output of ours, but not one whose files changed since
    with pytest.raises(OutputExistsError, match="would delete model.py"):
        emit(conv, out, force=True)
    assert (out / "model.py").stat().st_mtime_ns == old_stat.st_mtime_ns
    shutil.rmtree(out)
    emit(conv, out)
    emit(conv, out, force=True)
    assert (out / "model.py").is_file() and "# stale" not in (out / "model.py").read_text()
    assert _leftovers(tmp_path, "o") == ["o"]


def test_force_refuses_a_folder_mpconvert_did_not_write(outputs, tmp_path):
    conv, _ = outputs["mlp"]
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"not one \(it has no \.mpconvert-output\.json\)"):
        emit(conv, out, force=True)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path, "o") == ["o"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_during_emit_leaves_nothing(outputs, tmp_path, monkeypatch, exc):
    conv, _ = outputs["mlp"]

    def boom(*_a, **_k):
        raise exc

    monkeypatch.setattr(artifacts_mod, "_write_reports", boom)
    with pytest.raises(type(exc)):
        emit(conv, tmp_path / "nested" / "o")
    assert list(tmp_path.iterdir()) == []  # not even the parent it would have created


def test_failure_with_force_keeps_the_old_directory(outputs, tmp_path, monkeypatch):
    conv, _ = outputs["mlp"]
    out = tmp_path / "o"
    emit(conv, out)
    before = sorted(os.listdir(out))
    model_py = (out / "model.py").read_bytes()
    monkeypatch.setattr(artifacts_mod, "_write_reports", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        emit(conv, out, force=True)
    assert sorted(os.listdir(out)) == before and (out / "model.py").read_bytes() == model_py
    assert _leftovers(tmp_path, "o") == ["o"]


_SLOW_EMIT = """
import signal, sys, time
# the CLI's own handling of Ctrl-C is under test: a SIGINT disposition inherited from the test runner's worker
# (an ignored SIGINT survives exec) must not decide the outcome
print("inherited SIGINT:", signal.getsignal(signal.SIGINT), flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
import converter.export.artifacts as artifacts
_write = artifacts._write_text
def _slow(path, text):
    _write(path, text)
    time.sleep(2)
artifacts._write_text = _slow  # the test's own process only: emit pauses after each text file
from converter.cli.main import main
sys.exit(main(sys.argv[1:] + ["--device-profile", "none"]))
"""


def test_sigint_during_emit_leaves_no_directory(tmp_path):
    script = tmp_path / "slow_emit.py"
    script.write_text(_SLOW_EMIT)
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, str(script), str(SAMPLES / "mlp.py"), "--out", str(out)],
                            cwd=tmp_path, env=_train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if any(p.name.startswith(".interrupted.tmp-") and (p / "model.py").exists() for p in tmp_path.iterdir()):
                break
            if proc.poll() is not None:
                pytest.fail(f"mpconvert ended before emit started: {proc.communicate()}")
            time.sleep(0.05)
        else:
            pytest.fail("emit never started")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == ["mpconvert: error: interrupted; nothing was written"]
    assert _leftovers(tmp_path, "interrupted") == []


# ---------------------------------------------------------------------------------------------
# export graphs with nested inputs, dict outputs, constants; leaf modules; devices


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("nb", torch.linspace(0.5, 1.5, 4), persistent=False)
        self.c = torch.arange(4.0)  # a plain tensor attribute: a constant of the graph

    def forward(self, xs, y=None, flag=True):
        a, b = xs
        out = self.bn(self.l(a)) + b * self.nb + self.c
        return {"out": out, "pair": (out * 2, y)}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_nested_inputs_dict_outputs_and_constants(tracer, tmp_path):
    torch.manual_seed(0)
    model = _Nested().eval()
    example = (([torch.randn(2, 4), torch.randn(2, 4)],), {"y": torch.randn(2, 4), "flag": True})
    conv = converter.convert(model, example, tracer=tracer)
    out = emit(conv, tmp_path / "o")
    loaded = import_file(out / "model.py").load()
    args, kwargs = conv.example_inputs
    got = loaded(*args, **kwargs)
    ref = conv.module(*args, **kwargs)
    assert torch.equal(got["out"], ref["out"]) and torch.equal(got["pair"][0], ref["pair"][0])
    assert torch.equal(got["pair"][1], kwargs["y"])
    assert "nb" in dict(loaded.named_buffers())
    assert set(loaded.state_dict()) == set(conv.module.state_dict())  # persistence kept as conv.module has it


class _Custom(nn.Module):
    def forward(self, x):
        return x * 2


class _WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.custom = _Custom()

    def forward(self, x):
        return self.custom(self.fc(x))


def _fake_conv(model, gm, example):
    return SimpleNamespace(module=gm, original=model, precision="bf16", tracer="fx", report=None,
                           example_inputs=(example, {}))


def test_unknown_custom_leaf_is_a_clear_error():
    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, _Custom) or super().is_leaf_module(m, qualname)

    model = _WithCustom()
    gm = torch.fx.GraphModule(model, LeafTracer().trace(model))
    with pytest.raises(EmitError, match=r"cannot re-create leaf module 'custom' of type .*_Custom.*--tracer export"):
        generate_model_source(_fake_conv(model, gm, (torch.randn(2, 4),)))


def test_torch_leaf_modules_are_recreated_exactly(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=None), nn.ReLU(inplace=True),
                          nn.MaxPool2d(2, ceil_mode=True), nn.Dropout(0.25), nn.GELU(approximate="tanh"),
                          nn.AdaptiveAvgPool2d(1), nn.Hardtanh(-2.0, 2.0))
    model.train()
    gm = torch.fx.symbolic_trace(model)
    example = (torch.randn(2, 3, 9, 9),)
    source = generate_model_source(_fake_conv(model, gm, example))
    path = tmp_path / "model.py"
    path.write_text(source.code)
    write_weights(source.tensors, tmp_path)
    loaded = import_file(path).load()
    assert loaded.training
    for name, sub in model.named_children():
        assert repr(loaded.get_submodule(name)) == repr(sub)
    torch.manual_seed(5)
    ref = gm(*example)
    torch.manual_seed(5)
    assert torch.equal(loaded(*example), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_device_cuda_without_cuda_writes_nothing(outputs, tmp_path):
    conv, _ = outputs["mlp"]
    with pytest.raises(EmitError, match="CUDA is not available"):
        emit(conv, tmp_path / "o", device="cuda")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_cuda_checks_the_emitted_model(tmp_path):  # pragma: no cover - needs a GPU
    conv = _convert("hf_gpt2")
    notes = []
    emit(conv, tmp_path / "o", device="cuda", messages=notes)
    assert any("runs on cuda" in n for n in notes)

"""Weights are never silently invented or kept (issue 44 item 1).

On the old code:
* ``mpconvert FOLDER`` whose safetensors checkpoint lacked ``model.layers.0.mlp.down_proj.weight`` exited 0
  with that weight randomly initialised by transformers, without a word;
* model.py's strict ``load(weights=CKPT)`` checked only the tensors it declares itself, not those of the
  torch.nn leaf modules it re-creates (a batch norm under the fx tracer): a checkpoint holding only the conv
  and linear weights loaded, keeping the conversion-time batch norm weights and statistics, while the
  model's own complete ``state_dict`` (``b1.bn.num_batches_tracked``, ...) was refused as "does not match";
* ``train.py --save`` of such a model died in ``torch.save`` ("view the same data as different types"): the
  tensors of model.py are views, in several dtypes, of one memory-mapped weight file.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import assert_bad_input, run
from torch import nn

import converter
from tests.helpers import ROOT

transformers = pytest.importorskip("transformers")

MISSING = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def llama_missing(tmp_path_factory):
    """A small Llama's save_pretrained folder whose model.safetensors lacks one MLP weight."""
    folder = tmp_path_factory.mktemp("folders") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )).save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    del state[MISSING]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_checkpoint_lacking_a_tensor_exits_2_naming_it(llama_missing, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capfd, llama_missing, "--out", tmp_path / "out", "--no-measure", "--load-weights")
    assert_bad_input(code, out, err, f"lacks 1 tensor(s) the model needs ({MISSING})", "--allow-missing-weights")
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []


def test_allow_missing_weights_initialises_them_with_a_warning_naming_each(llama_missing, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capfd, llama_missing, "--out", tmp_path / "out", "--no-measure", "--load-weights",
                         "--allow-missing-weights")
    assert code == 0, err
    warned = [line for line in err.splitlines() if "initialised randomly" in line]
    assert len(warned) == 1 and warned[0].startswith("mpconvert: warning: ") and warned[0].endswith(MISSING), err
    source = json.loads((tmp_path / "out" / "report.json").read_text())["source"]
    assert source["initialised_randomly"] == [MISSING] and source["unused"] == [], source
    assert MISSING in source["note"]


# ---------------------------------------------------------------------------------------------
# model.py's load(weights=): strict over the leaf modules' tensors, and every form of the state_dict


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1 = Block(3, 8)
        self.b2 = Block(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.b2(self.b1(x)).mean(dim=(2, 3)))


_MODEL_FILE = f'''
import torch
from torch import nn

{__import__("inspect").getsource(Block)}

{__import__("inspect").getsource(Net)}

def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output.float(), batch)


def train_batches():
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        yield (torch.randn(4, 3, 8, 8, generator=gen),), torch.randint(0, 4, (4,), generator=gen)
'''


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained(net: nn.Module) -> nn.Module:
    """``net`` after two SGD steps in train mode: weights, running statistics and counters all moved."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 3, 8, 8, generator=gen)).square().mean().backward()
        opt.step()
    return net


@pytest.fixture(scope="module", params=["fx", "export"])
def emitted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"bn_{request.param}")
    (tmp / "bn_model.py").write_text(_MODEL_FILE)
    user = _import(tmp / "bn_model.py", f"bn_user_{request.param}")
    net = user.build_model().train()
    conv = converter.convert(net, user.example_inputs(), precision="bf16", tracer=request.param)
    conv.save(tmp / "out", model_file=str(tmp / "bn_model.py"))
    return request.param, tmp, user, conv, _import(tmp / "out" / "model.py", f"bn_model_py_{request.param}")


def _save(state: dict, path) -> str:
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return str(path)


def test_a_checkpoint_without_the_batch_norm_tensors_is_refused_naming_them(emitted, tmp_path):
    tracer, _, user, _, model_py = emitted
    if tracer == "fx":  # the batch norms are torch.nn leaves of model.py, their tensors not in PARAMETERS/BUFFERS
        assert "b1.bn.weight" not in model_py.PARAMETERS and "b1.bn.running_mean" not in model_py.BUFFERS
    full = _trained(user.build_model().train()).state_dict()
    convs_only = {k: v for k, v in full.items() if ".bn." not in k}  # the conv and linear weights (4 of 14)
    with pytest.raises(ValueError, match=r"it lacks 'b1\.bn\.bias', 'b1\.bn\.num_batches_tracked', "
                                         r"'b1\.bn\.running_mean' and 7 more \(10\)"):
        model_py.load(weights=_save(convs_only, tmp_path / "convs_only.safetensors"))
    no_stats = {k: v for k, v in full.items() if "running" not in k and "num_batches" not in k}
    with pytest.raises(ValueError, match=r"it lacks 'b1\.bn\.num_batches_tracked', 'b1\.bn\.running_mean', "
                                         r"'b1\.bn\.running_var' and 3 more \(6\)"):
        model_py.load(weights=no_stats)


def _assert_loaded(model: nn.Module, state: dict, what: str) -> None:
    """Every tensor of ``state`` is the loaded model's, bit for bit (in the model's dtype)."""
    mine = model.state_dict()
    assert set(mine) == set(state), (what, sorted(set(mine) ^ set(state)))
    differ = [k for k, v in state.items() if not torch.equal(mine[k], v.to(mine[k].dtype))]
    assert differ == [], f"{what}: {differ} keep other values than the checkpoint's"


def test_every_form_of_the_models_state_dict_loads(emitted, tmp_path):
    _, _, user, conv, model_py = emitted
    original = _trained(user.build_model().train()).state_dict()
    assert int(original["b1.bn.num_batches_tracked"]) == 2
    forms = {
        "the original's state_dict (a dict)": (original, original),
        "the original's, as .safetensors": (_save(original, tmp_path / "orig.safetensors"), original),
        "the converted module's": (conv.module.state_dict(), conv.module.state_dict()),
        "model.py's own": (model_py.load().state_dict(), model_py.load().state_dict()),
    }
    torch.save(original, tmp_path / "orig.pt")
    forms["the original's, torch.save'd and read weights-only"] = (torch.load(tmp_path / "orig.pt", weights_only=True),
                                                                     original)
    for what, (weights, state) in forms.items():
        _assert_loaded(model_py.load(weights=weights), state, what)
    # a dict's tensors are copied: training the loaded model leaves the checkpoint's model as it was
    loaded = model_py.load(weights=original)
    with torch.no_grad():
        loaded.head.weight.add_(1.0)
    assert not torch.equal(loaded.head.weight, original["head.weight"])


def test_train_py_o2_save_writes_a_half_checkpoint_that_model_py_loads(emitted, tmp_path):
    """train.py --o2 --save: the half-stored state_dict (MixedPrecisionTrainer's O2 model), int64 counters and
    fp32 batch norm tensors in one file; before, torch.save refused it."""
    _, tmp, _, _, model_py = emitted
    ckpt = tmp_path / "o2.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(tmp / "out" / "train.py"), "--o2", "--steps", "2", "--save", str(ckpt)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["head.weight"].dtype == torch.bfloat16 and saved["b1.bn.running_mean"].dtype == torch.float32
    assert saved["b1.bn.num_batches_tracked"].dtype == torch.int64 and int(saved["b1.bn.num_batches_tracked"]) == 2
    _assert_loaded(model_py.load(weights=saved), saved, "train.py --o2 --save")
    with pytest.raises(ValueError, match=r"is a torch.save file, which model.py does not read: read it with torch's "
                                         r"weights-only loader"):
        model_py.load(weights=str(ckpt))  # model.py never unpickles, not even weights-only
    assert sorted(os.listdir(tmp_path)) == ["o2.pt"]
    shutil.rmtree(tmp / "out" / "__pycache__", ignore_errors=True)

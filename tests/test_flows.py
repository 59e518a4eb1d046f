"""What one feature writes, the next one reads (issue 43, item 1): each flow end to end, as a user runs it.

Each test starts in a fresh folder, runs the command line (in process, ``main([...])``, or as a
subprocess where the user would: train.py), then the next command on what the first one wrote. On
412bc85 none of these held:

* convert -> ``explain OUT_DIR NODE``: exit 2, "'sqnr_db' of row 'embed' is a str" (the writer wrote an
  exact SQNR as "inf", the strict reader refused it);
* convert -> ``audit OUT_DIR``: exit 2, "OUT_DIR is a folder ... e.g. OUT_DIR/model.py", whose model.py
  then is no model file either;
* a BERT save_pretrained folder -> model.py without ``token_type_ids``: TypeError;
* ``--precision fp8`` on a model whose linears are all under the size gate: "Converted ... to bf16" only;
* convert fp8 -> ``MixedPrecisionTrainer(precision="fp8")``: PrecisionError;
* train.py --save -> model.py ``load(weights=)``: "not a safetensors file";
* convert --onnx -> onnxruntime, and apply -> save_pretrained -> from_pretrained -> apply.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import converter
from converter.cli.main import main
from tests.helpers import ROOT, SAMPLES, sqnr
from tests.test_cli import run

transformers = pytest.importorskip("transformers")
TINY = SAMPLES / "tiny_transformer.py"


def _load_model_py(directory, name):
    spec = importlib.util.spec_from_file_location(name, directory / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny():
    spec = importlib.util.spec_from_file_location("flows_tiny", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_mp(tmp_path_factory):
    """``mpconvert samples/tiny_transformer.py --onnx`` into a fresh folder (bf16; measured, so SQNRs are in the report)."""
    out = tmp_path_factory.mktemp("flows") / "tiny_mp"
    assert main([str(TINY), "--out", str(out), "--onnx", "-q"]) == 0
    return out


# ---------------------------------------------------------------------------------------------
# convert -> explain, convert -> audit


def test_convert_then_explain_answers_from_the_report(tiny_mp, capfd):
    data = json.loads((tiny_mp / "report.json").read_text())
    embed = next(r for r in data["nodes"] if r["name"] == "embed")
    assert embed["sqnr_db"] == "inf", embed.get("sqnr_db")  # an exact node: the documented string, which the reader takes
    code, out, err = run(capfd, "explain", tiny_mp, "embed")
    assert code == 0, err
    assert out.startswith("embed: op embedding"), out
    assert "measured: cumulative SQNR exact, local SQNR exact" in out, out
    assert f"explained from {tiny_mp / 'report.json'}" in err, err
    lossy = next(r for r in data["nodes"] if isinstance(r.get("sqnr_db"), float) and r["precision"] == "bf16")
    code, out, err = run(capfd, "explain", tiny_mp, lossy["name"])
    assert code == 0, err
    assert f"cumulative SQNR {lossy['sqnr_db']:.1f} dB" in out, out
    code, out, err = run(capfd, "explain", tiny_mp, "embed", "--json")
    assert code == 0, err
    assert json.loads(out)["precision"] == "fp32"


def test_convert_then_audit_of_the_output_audits_its_model(tiny_mp, tmp_path, capfd):
    code, out, err = run(capfd, "audit", tiny_mp, "--out", tmp_path / "again")
    assert code == 0, err
    assert f"using {tiny_mp / 'user_model.py'}, the model file it was converted from" in err, err
    converted = json.loads((tiny_mp / "report.json").read_text())
    audited = json.loads((tmp_path / "again" / "report.json").read_text())
    decisions = [(r["name"], r["precision"], r["rule"]) for r in converted["nodes"]]
    assert [(r["name"], r["precision"], r["rule"]) for r in audited["nodes"]] == decisions
    code, out, err = run(capfd, "explain", tmp_path / "again", "embed")  # and the audit's report explains too
    assert code == 0 and out.startswith("embed: op embedding"), (code, out, err)


def test_audit_of_a_folder_conversion_output_says_what_to_pass(tmp_path, capfd):
    folder = tmp_path / "bert_mp"
    folder.mkdir()
    for name in ("report.json", "model.py", "model.safetensors"):
        (folder / name).write_text("{}")
    code, out, err = run(capfd, "audit", folder)
    assert code == 2, err
    assert "is an output directory of mpconvert with no copy of its model file" in err and f"explain {folder} NODE" in err, err


# ---------------------------------------------------------------------------------------------
# a save_pretrained folder -> model.py / conv.module with the original's optional arguments


def _bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32)).eval()


def _padded(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (batch,), generator=gen)
    lengths[0] = width
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return torch.randint(1, 128, (batch, width), generator=gen) * mask, mask


def test_folder_model_py_takes_the_originals_optional_arguments(tmp_path, capfd):
    _bert().save_pretrained(tmp_path / "bert")
    code, out, err = run(capfd, tmp_path / "bert", "--out", tmp_path / "bert_mp", "--no-measure", "-q")
    assert code == 0, err
    net = _load_model_py(tmp_path / "bert_mp", "flows_bert_mp").load()
    assert str(inspect.signature(net.forward)) == "(input_ids, attention_mask=None, token_type_ids=None)"
    original = _bert()
    ids, mask = _padded(3, 12, 5)  # a size the example did not have
    types = torch.zeros_like(ids)
    real = mask.bool()
    with torch.no_grad():
        given = net(input_ids=ids, attention_mask=mask, token_type_ids=types)["last_hidden_state"]
        left_out = net(input_ids=ids, attention_mask=mask)["last_hidden_state"]
        only_ids = net(ids)["last_hidden_state"]
        ones = net(input_ids=ids, attention_mask=torch.ones_like(mask))["last_hidden_state"]
        want = original(input_ids=ids, attention_mask=mask).last_hidden_state
        want_ids = original(input_ids=ids).last_hidden_state
    assert torch.equal(left_out, given), "token_type_ids left out must be the original's zeros"
    assert torch.equal(only_ids, ones), "attention_mask left out must be the original's ones"
    db, db_ids = sqnr(want[real], left_out.float()[real]), sqnr(want_ids, only_ids.float())
    assert db > 60.0 and db_ids > 60.0, (db, db_ids)  # measured 77 and 78 dB (bf16); a wrong fill gives < 20
    # gradients through model.py with the optional arguments left out: the original's (eval mode: no dropout draws)
    # (a random projection of the output: the gradient of a plain sum of squares vanishes behind the final LayerNorm)
    r = torch.randn(want[real].shape, generator=torch.Generator().manual_seed(8))
    (net(input_ids=ids, attention_mask=mask)["last_hidden_state"][real].float() * r).sum().backward()
    (original(input_ids=ids, attention_mask=mask).last_hidden_state[real] * r).sum().backward()
    for name in ("word_embeddings", "token_type_embeddings"):  # the fill's zeros: all the gradient in row 0, as the original's
        want_grad = getattr(original.embeddings, name).weight.grad
        got_grad = getattr(net.embeddings, name).weight.grad.float()
        assert sqnr(want_grad, got_grad) > 40.0, (name, sqnr(want_grad, got_grad))  # measured 76-78 dB


def test_conv_module_keeps_the_optional_arguments_with_their_defaults():
    original = _bert()
    ids, mask = _padded(2, 16, 1)
    types = (torch.arange(16) >= 8).long().expand(2, 16) * mask
    conv = converter.convert(original, ((), {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}))
    assert str(inspect.signature(conv.module.forward)) == "(input_ids, attention_mask=None, token_type_ids=None)"
    facts = conv.report.records.optional_inputs.to_dict()
    assert [(o["name"], o["fill"]) for o in facts["optional"]] == [("attention_mask", 1), ("token_type_ids", 0)], facts
    ids2, mask2 = _padded(3, 10, 2)
    with torch.no_grad():
        left_out = conv.module(input_ids=ids2, attention_mask=mask2)["last_hidden_state"]
        as_none = conv.module(input_ids=ids2, attention_mask=mask2, token_type_ids=None)["last_hidden_state"]
        given = conv.module(input_ids=ids2, attention_mask=mask2, token_type_ids=torch.zeros_like(ids2))["last_hidden_state"]
        want = original(input_ids=ids2, attention_mask=mask2).last_hidden_state
    assert torch.equal(left_out, given) and torch.equal(as_none, given)
    assert sqnr(want[mask2.bool()], left_out.float()[mask2.bool()]) > 60.0


def test_an_optional_argument_the_original_fills_from_the_data_stays_required():
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 4)

        def forward(self, ids, mask=None):
            if mask is None:
                mask = ids != 0  # a data-dependent default: no constant tensor stands for it
            return self.out(self.embed(ids) * mask.unsqueeze(-1))

    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    ids[1, 5:] = 0
    conv = converter.convert(Tagger(), ((), {"ids": ids, "mask": torch.ones_like(ids, dtype=torch.bool)}), tracer="export")
    facts = conv.report.records.optional_inputs.to_dict()
    assert facts["optional"] == [] and "something else than a constant" in facts["required"]["mask"], facts
    assert str(inspect.signature(conv.module.forward)) == "(ids, mask)"


# ---------------------------------------------------------------------------------------------
# fp8: the summary, the trainer, train.py and load(weights=)


_WIDE_MLP = '''
import torch
from torch import nn


class WideMLP(nn.Module):
    def __init__(self, d=1024):
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, 64)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def build_model():
    torch.manual_seed(0)
    return WideMLP()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(4, 64),)


def loss_fn(output, batch):
    return output.float().pow(2).mean()


def train_batches():
    gen = torch.Generator().manual_seed(2)
    return [((x,), (x,)) for x in (torch.randn(4, 64, generator=gen) for _ in range(4))]
'''


def test_fp8_summary_says_why_no_layer_runs_fp8(tmp_path, capfd):
    code, out, err = run(capfd, TINY, "--precision", "fp8", "--out", tmp_path / "tiny_fp8", "--no-measure")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("Converted"))
    assert "fp8: 0 of 11 linear layers run fp8 GEMMs (tensorwise), none: 7 below fp8_min_flops_per_token = 2097152" in line, line
    assert "1 by fp8_keep_first = True" in line, line
    report = json.loads((tmp_path / "tiny_fp8" / "report.json").read_text())
    assert report["summary_line"] == line
    gate = next(k for k in report["fp8"]["kept_bf16"] if k.get("setting") == "fp8_min_flops_per_token")
    assert gate == {"rule": "fp8.toml:[settings].fp8_min_flops_per_token", "count": 7, "setting": "fp8_min_flops_per_token",
                    "value": 2097152}


def test_fp8_summary_counts_the_layers_that_run_fp8(tmp_path, capfd):
    model = tmp_path / "wide.py"
    model.write_text(textwrap.dedent(_WIDE_MLP))
    code, out, err = run(capfd, model, "--precision", "fp8", "--out", tmp_path / "wide_mp", "--no-measure")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("Converted"))
    assert line.endswith("; fp8: 1 of 3 linear layers run fp8 GEMMs (tensorwise)"), line  # inp and out: keep_first/last


def test_fp8_conversion_trains_with_the_trainer_and_train_py_and_reloads(tmp_path):
    spec = importlib.util.spec_from_file_location("flows_wide", _write(tmp_path / "wide.py", _WIDE_MLP))
    wide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wide)
    conv = converter.convert(wide.build_model(), wide.example_inputs(), precision="fp8")
    assert conv.report.records.fp8.layers == ["mid"], conv.report.records.fp8.layers
    for o2 in (False, True):
        module = converter.convert(wide.build_model(), wide.example_inputs(), precision="fp8").module
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        trainer = converter.MixedPrecisionTrainer(module, opt, precision="fp8", master_weights=o2)
        assert trainer.scaler is None  # fp8 trains as its bf16: no loss scaling
        losses = []
        for (x,), _ in wide.train_batches() * 2:
            loss = wide.loss_fn(module(x), (x,))
            trainer.backward(loss)
            trainer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0], (o2, losses)
    # the CLI's output: train.py --save (a subprocess, as the user runs it), then model.py load(weights=)
    assert main([str(tmp_path / "wide.py"), "--precision", "fp8", "--out", str(tmp_path / "wide_mp"), "--no-measure", "-q"]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py", "--steps", "3", "--save", str(tmp_path / "trained.pt")],
                          cwd=tmp_path / "wide_mp", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the GEMMs of 1 linear(s) in fp8" in done.stdout + done.stderr, done.stdout[-1000:]
    mp = _load_model_py(tmp_path / "wide_mp", "flows_wide_mp")
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    with pytest.raises(ValueError, match="weights_only=True"):  # model.py reads no pickle: the caller does
        mp.load(weights=str(tmp_path / "trained.pt"))
    net = mp.load(weights=trained)
    state = net.state_dict()
    assert set(state) == set(trained)
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert not torch.equal(mp.load().state_dict()["mid.weight"], trained["mid.weight"])  # it did train


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_load_weights_refuses_what_is_not_a_state_dict(tiny_mp, tmp_path):
    mp = _load_model_py(tiny_mp, "flows_tiny_mp_refuse")
    torch.save({"a": 1, "b": [torch.ones(2)]}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="weights_only=True"):  # a torch.save path: read it with torch, pass the dict
        mp.load(weights=str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="not a dict of named tensors"):
        mp.load(weights={"a": 1, "b": [torch.ones(2)]})


# ---------------------------------------------------------------------------------------------
# convert --onnx -> onnxruntime


def test_convert_onnx_runs_in_onnxruntime(tiny_mp):
    ort = pytest.importorskip("onnxruntime")
    tiny = _tiny()
    model = tiny.build_model().eval()
    example = tiny.example_inputs()
    args = example if isinstance(example, tuple) else (example,)
    session = ort.InferenceSession(str(tiny_mp / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    got = torch.from_numpy(session.run(None, feeds)[0])
    with torch.no_grad():
        want = model(*args)
        want = want if isinstance(want, torch.Tensor) else want[0]
    assert got.shape == want.shape
    db = sqnr(want.double(), got.double())
    assert db > 50.0, db  # the fp16 export of the bf16 conversion: measured 73.6 dB; a bf16 or broken cast gives < 45


# ---------------------------------------------------------------------------------------------
# apply -> save_pretrained -> from_pretrained -> apply again


def test_apply_save_pretrained_from_pretrained_apply_again(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        fp32 = model(input_ids=ids).logits
    model = converter.apply(model, ((), {"input_ids": ids}))
    with torch.no_grad():
        first = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "applied")
    saved = {p.dtype for p in model.state_dict().values()}
    assert saved == {torch.float32}, saved  # the checkpoint is the fp32 model's, as before apply
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "applied").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, fp32)  # the weights round-tripped exactly
    again = converter.apply(again, ((), {"input_ids": ids}))
    with torch.no_grad():
        second = again(input_ids=ids).logits
    assert torch.equal(second, first)
    assert 30.0 < sqnr(fp32, second.float()) < 120.0, sqnr(fp32, second.float())  # half precision, not fp32

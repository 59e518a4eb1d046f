"""Partial capture: research-style models that no tracer captures whole convert region by region.

Each model in tests/research/ is written the way papers' repositories write them (a patience-based
early exit, a ponder loop, greedy decoding to EOS, an NMS loop, MoE dispatch, packed sequences, a
GNN pooling on ``int(batch.max())``, asserts, numpy in forward, Python ``random``, a forward-updated
counter, a chunk loop that pins a dim, ``.item()``/``.tolist()``). torch.autocast runs each of them;
so must we. Every check here also proves that half precision ran (bf16/fp16 nodes, a half-FLOP share,
and an SQNR below what an fp32 model would give).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from helpers import sqnr, torch_only_python
from research import NAMES, RESEARCH, against_autocast, as_call, flat, floats, load

import converter
from converter.cli.main import main as cli_main

pytestmark = pytest.mark.slow

#: models that are one graph after all (a chunk loop over a static length: the pinned-dim case)
WHOLE = {"chunked_rwkv"}
#: models whose heavy layers are not submodules the FLOP rule speaks of (the LSTM itself dominates the packed tagger)
FLOP_EXEMPT = {"packed_lstm"}
#: the largest SQNR a half-precision conversion can show: fp32 everywhere would give +inf (or > 140 dB)
HALF_CEILING_DB = 120.0


# ---------------------------------------------------------------------------------------------
# the CLI, once per model


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("research")
    runs = {}
    for name in NAMES:
        path = work / f"{name}.py"
        path.write_text((RESEARCH / f"{name}.py").read_text())
        out = work / f"{name}_mp"
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = cli_main([str(path), "--out", str(out), "--quiet", "--no-measure"])
        runs[name] = (code, err.getvalue(), out)
    return runs


@pytest.mark.parametrize("name", NAMES)
def test_cli_converts_and_reports_its_breaks(cli_runs, name):
    code, err, out = cli_runs[name]
    assert code == 0, f"{name}: exit {code}: {err[-800:]}"
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    breaks = report["graph_breaks"]
    assert summary["break_count"] == len(breaks) >= (0 if name in WHOLE else 1), (name, summary["break_count"], breaks)
    for entry in breaks:  # the user's file:line of every break, and how that part runs
        assert entry["location"].startswith(f"{name}.py:") and entry["location"].split(":")[1].isdigit(), (name, entry)
        assert entry["runs"] == "eager under autocast(bf16)" and entry["reason"], (name, entry)
    if name not in FLOP_EXEMPT:
        assert summary["captured_flop_fraction"] >= 0.75, (name, summary["captured_flop_fraction"], breaks)
    # half precision ran: bf16 nodes carrying most of the converted graphs' FLOPs
    assert summary["by_precision"]["bf16"] > 0 and summary["half_flop_fraction"] >= 0.5, (name, summary)
    assert {"model.py", "user_model.py", "model.safetensors", "train.py", "report.md"} <= {p.name for p in out.iterdir()}
    assert ("## Graph breaks" in (out / "report.md").read_text()) == bool(breaks), name


def test_no_breaks_refuses_in_one_line(tmp_path, capfd):
    path = tmp_path / "pabee.py"
    path.write_text((RESEARCH / "pabee.py").read_text())
    code = cli_main([str(path), "--out", str(tmp_path / "out"), "--no-breaks"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "capture" in err[0], (code, err)
    assert not (tmp_path / "out").exists()


def test_onnx_of_a_partial_conversion_names_the_break(tmp_path, capfd):
    """ONNX needs one graph: --onnx says in one line which break prevents it; the other artifacts are written."""
    path = tmp_path / "pabee.py"
    path.write_text((RESEARCH / "pabee.py").read_text())
    code = cli_main([str(path), "--out", str(tmp_path / "out"), "--onnx", "--no-measure", "--quiet"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("mpconvert: error")]
    assert code == 1 and len(err) == 1, (code, err)
    assert "graph break" in err[0] and "pabee.py:" in err[0] and "ONNX" in err[0], err[0]
    assert (tmp_path / "out" / "model.py").is_file() and not (tmp_path / "out" / "model.onnx").exists()


_STANDALONE = textwrap.dedent("""
    import importlib.util, sys, traceback
    for banned in ("converter", "transformers"):
        assert importlib.util.find_spec(banned) is None, banned + " is importable in the torch-only venv"
    import torch
    jobs = torch.load(sys.argv[1], weights_only=True)
    results = {}
    for name, (model_py, args, kwargs) in jobs.items():
        try:
            spec = importlib.util.spec_from_file_location("emitted_" + name, model_py)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.load()
            model.eval()
            with torch.no_grad():
                torch.manual_seed(0)
                out = model(*args, **kwargs)
            results[name] = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                             if isinstance(t, torch.Tensor)]
        except Exception:
            results[name] = "error: " + traceback.format_exc(limit=-3)
    torch.save(results, sys.argv[2])
""")


def test_model_py_runs_in_a_torch_only_venv(cli_runs, tmp_path):
    """Each emitted model.py (user code + region graphs) loads without our package and gives conv.module's outputs:
    the in-process load is checked bit for bit against conv.module when the folder is written."""
    from converter.export.verify import import_file

    jobs, want = {}, {}
    for name in NAMES:
        code, _, out = cli_runs[name]
        assert code == 0, name
        args, kwargs = as_call(load(name).example_inputs())
        jobs[name] = (str(out / "model.py"), args, kwargs)
        model = import_file(out / "model.py").load()
        model.eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            result = model(*args, **kwargs)
        want[name] = [t for t in (result if isinstance(result, (tuple, list)) else [result]) if isinstance(t, torch.Tensor)]
    python = torch_only_python(tmp_path, extra=("numpy",))  # numpy: the research models' own code imports it
    torch.save(jobs, tmp_path / "jobs.pt")
    (tmp_path / "run.py").write_text(_STANDALONE)
    proc = subprocess.run([python, str(tmp_path / "run.py"), str(tmp_path / "jobs.pt"), str(tmp_path / "got.pt")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    for name in NAMES:
        assert not isinstance(got[name], str), f"{name}: {got[name]}"
        assert len(got[name]) == len(want[name]) and all(torch.equal(a, b) for a, b in zip(got[name], want[name])), name


# ---------------------------------------------------------------------------------------------
# numerics: outputs and gradients against fp32, beside autocast's


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_outputs_and_gradients_match_autocast(name, precision):
    mf = load(name)
    args, kwargs = as_call(mf.example_inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(mf.build_model(), (args, kwargs), precision=precision)
        assert bool(conv.graph_breaks) != (name in WHOLE), f"{name}: graph breaks {conv.graph_breaks}"
        found = against_autocast(mf, conv.module, precision)
    summary = conv.report.summary
    assert summary["by_precision"][precision] > 0 and summary["half_flop_fraction"] >= 0.5, (name, summary)
    db, auto_db = found["output_db"], found["autocast_output_db"]
    gdb, auto_gdb = found["grad_db"], found["autocast_grad_db"]
    assert db >= auto_db - 1.0, f"{name} {precision}: output SQNR {db:.1f} dB, autocast {auto_db:.1f} dB (medians)"
    assert gdb >= auto_gdb - 1.0, f"{name} {precision}: gradient SQNR {gdb:.1f} dB, autocast {auto_gdb:.1f} dB (medians)"
    assert db < HALF_CEILING_DB and gdb < HALF_CEILING_DB, f"{name}: SQNR {db:.1f}/{gdb:.1f} dB: did half precision run?"


# ---------------------------------------------------------------------------------------------
# training: MixedPrecisionTrainer fp16 O2 against autocast + GradScaler


STEPS = 6


def _steps_autocast(mf) -> int:
    model = mf.build_model()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    batches, taken = mf.train_batches(), 0
    for _ in range(STEPS):
        inputs, batch = next(batches)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mf.loss_fn(model(*inputs), batch)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        taken += int(scaler.get_scale() >= scale)
    return taken


@pytest.mark.parametrize("name", NAMES)
def test_trains_fp16_o2_as_often_as_gradscaler(name):
    mf = load(name)
    args, kwargs = as_call(mf.example_inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(mf.build_model(), (args, kwargs), precision="fp16", opt_level="O2")
        # a model captured whole is one GraphModule, which does not re-capture other sizes itself; the applied model does
        module = conv.module if name not in WHOLE else converter.apply(mf.build_model(), (args, kwargs), precision="fp16",
                                                                       opt_level="O2")
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
        trainer = converter.MixedPrecisionTrainer(module, opt, precision="fp16", master_weights=True)
        batches, taken, losses = mf.train_batches(), 0, []
        for _ in range(STEPS):
            inputs, batch = next(batches)
            trainer.zero_grad()
            loss = mf.loss_fn(module(*inputs), batch)
            trainer.backward(loss)
            taken += int(trainer.step())
            losses.append(float(loss))
        reference = _steps_autocast(mf)
    assert all(math.isfinite(x) for x in losses), (name, losses)
    assert taken >= reference, f"{name}: {taken} of {STEPS} steps taken, autocast + GradScaler took {reference}"
    half = [n for n, p in module.named_parameters() if p.dtype == torch.float16]
    assert half, f"{name}: O2 stored no parameter in fp16"


# ---------------------------------------------------------------------------------------------
# never silently wrong at trace time


def test_layerdrop_draws_on_every_call():
    mf = load("layerdrop")
    args, kwargs = as_call(mf.example_inputs())
    model = mf.build_model()
    conv = converter.convert(model, (args, kwargs))
    (brk,) = [b for b in conv.graph_breaks if b.module == ""]
    assert "random" in brk.reason and brk.location.startswith("layerdrop.py:"), brk
    module = conv.module
    module.train()
    random.seed(0)
    with torch.no_grad():
        outs = [module(*args, **kwargs) for _ in range(6)]
    distinct = {tuple(flat(floats(o))[:8].tolist()) for o in outs}
    assert len(distinct) > 1, "six train-mode calls gave one output: the draw was baked in"
    layers, calls, ran = len(model.layers), 300, 0
    with torch.no_grad():
        for _ in range(calls):
            module(*args, **kwargs)
            ran += module.last_ran
    skipped = 1 - ran / (layers * calls)
    sigma = math.sqrt(model.p * (1 - model.p) / (layers * calls))
    assert abs(skipped - model.p) < 4 * sigma, f"skipped {skipped:.3f} of layers, p = {model.p} (sigma {sigma:.3f})"


def test_forward_updated_counter_evolves_as_the_original():
    mf = load("annealed")
    args, kwargs = as_call(mf.example_inputs())
    original, twin = mf.build_model(), mf.build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(twin, (args, kwargs))
        assert any("calls" in b.reason for b in conv.graph_breaks), conv.graph_breaks
        original.train()
        conv.module.train()
        for step in range(5):
            with torch.no_grad():
                torch.manual_seed(step)
                ref = original(*args, **kwargs)
                torch.manual_seed(step)
                out = conv.module(*args, **kwargs)
            assert conv.module.calls == original.calls == step + 1, (conv.module.calls, original.calls)
            db = sqnr(flat(floats(ref)), flat(floats(out)))
            assert 20.0 < db < HALF_CEILING_DB, f"call {step}: {db:.1f} dB against the original's evolving output"


def test_pinned_dim_served_at_other_lengths(cli_runs):
    """chunked_rwkv asserts T % chunk == 0 and loops T // chunk times (captured whole, its length static): the applied
    model and conv.module serve other lengths (converted again), and model.py serves them or refuses in one line naming the dim."""
    from converter.export.verify import import_file

    mf = load("chunked_rwkv")
    args, kwargs = as_call(mf.example_inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = converter.apply(mf.build_model(), (args, kwargs))
        module = converter.convert(mf.build_model(), (args, kwargs)).module  # serves them too, converted again
    _, _, out = cli_runs["chunked_rwkv"]
    emitted = import_file(out / "model.py").load()
    for length in (24, 32):
        x = [a for a in args if isinstance(a, torch.Tensor)][0]
        longer = torch.randn(x.shape[0], length, *x.shape[2:], generator=torch.Generator().manual_seed(length)) \
            if x.is_floating_point() else torch.randint(0, int(x.max()) + 1, (x.shape[0], length),
                                                        generator=torch.Generator().manual_seed(length))
        call = tuple(longer if a is x else a for a in args)
        ref = mf.build_model().eval()
        applied.eval()
        module.eval()
        emitted.eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = flat(floats(ref(*call, **kwargs)))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = flat(floats(ref(*call, **kwargs)))
            got = flat(floats(applied(*call, **kwargs)))
            from_module = flat(floats(module(*call, **kwargs)))
            try:
                standalone = flat(floats(emitted(*call, **kwargs)))
            except ValueError as exc:  # model.py refuses a size its graph does not serve: one line naming the dim
                assert "dim" in str(exc) and "\n" not in str(exc), str(exc)
                standalone = None
        db, auto_db = sqnr(want, got), sqnr(want, auto)
        assert auto_db - 1.0 <= db < HALF_CEILING_DB, f"T={length}: {db:.1f} dB, autocast {auto_db:.1f} dB"
        module_db = sqnr(want, from_module)
        assert auto_db - 1.0 <= module_db < HALF_CEILING_DB, f"T={length}: conv.module {module_db:.1f} dB, autocast {auto_db:.1f} dB"
        if standalone is not None:
            assert sqnr(want, standalone) >= auto_db - 1.0, f"T={length}: model.py {sqnr(want, standalone):.1f} dB"


def test_a_model_captured_whole_has_no_partition():
    sys.path.insert(0, str(Path(__file__).parents[1] / "samples"))
    try:
        import tiny_transformer
    finally:
        sys.path.pop(0)
    conv = converter.convert(tiny_transformer.build_model(), tiny_transformer.example_inputs())
    assert conv.partition is None and conv.graph_breaks == [] and isinstance(conv.module, torch.fx.GraphModule)
    data = conv.report.to_dict()
    assert data["graph_breaks"] == [] and data["summary"]["captured_flop_fraction"] == 1.0
    assert data["summary"]["break_count"] == 0


def test_lightning_trains_a_partial_model_fp16_o2():
    """The Lightning plugin converts a research model region by region in place and trains it with fp16 O2."""
    import pytorch_lightning as pl

    from converter.lightning import MixedPrecision

    mf = load("pabee")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = mf.build_model()
            self.example_input_array = mf.example_inputs()

        def forward(self, *args):
            return self.model(*args)

        def training_step(self, batch, index):
            inputs, target = batch
            return mf.loss_fn(self(*inputs), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = [b for _, b in zip(range(4), mf.train_batches())]
    module = Module()
    trainer = pl.Trainer(max_steps=4, plugins=[MixedPrecision("16-mixed", opt_level="O2", submodule="model")],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    conv = converter.conversion_of(module.model)
    assert trainer.global_step == 4 and conv is not None and conv.graph_breaks, (trainer.global_step, conv)
    assert torch.float16 in {p.dtype for p in module.model.parameters()}, "O2 stored no weight in fp16"


def test_hf_trainer_trains_a_partial_model_bf16(tmp_path):
    """HF Trainer (bf16 on CPU: accelerate wraps forward in autocast) trains a MoE with a dispatch loop converted region
    by region in place: the loss goes down, the regions ran their converted graphs (no fallback), every parameter of
    the glue and of the regions was updated, and the checkpoint holds the trained weights."""
    import transformers

    mf = load("moe_dispatch")

    class MoELM(torch.nn.Module):  # what a user writes to give Trainer a loss
        def __init__(self):
            super().__init__()
            self.net = mf.build_model()

        def forward(self, input_ids, attention_mask, labels=None):
            logits, aux = self.net(input_ids, attention_mask)
            return {"loss": mf.loss_fn((logits, aux), (labels, attention_mask)), "logits": logits}

    model = MoELM()
    ids, mask = mf.example_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converter.apply(model, ((), {"input_ids": ids, "attention_mask": mask, "labels": ids}), precision="bf16")
    conv = converter.conversion_of(model)
    assert conv is not None and conv.graph_breaks and len(conv.partition.regions) >= 8, conv.partition
    assert any(d.precision == "bf16" for d in conv.decisions.values()), "no region node runs bf16"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(4):
        b_ids, b_mask = mf._batch(gen)
        rows += [{"input_ids": b_ids[i], "attention_mask": b_mask[i], "labels": b_ids[i]} for i in range(len(b_ids))]

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, max_steps=8, per_device_train_batch_size=4,
        learning_rate=3e-3, logging_steps=1, save_steps=8, report_to=[], seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)  # a list of rows is a map-style dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, f"loss did not go down: {losses}"
    fallbacks = {path: sub.forward.calls["fallback"] for path, sub in model.named_modules()
                 if isinstance(sub.__dict__.get("forward"), converter.inplace.ConvertedForward)}
    assert fallbacks and not any(fallbacks.values()), fallbacks
    after = model.state_dict()
    unchanged = [k for k, v in after.items() if v.is_floating_point() and torch.equal(v, before[k])]
    # an expert no token of these batches was routed to would keep its weights; every other tensor trains
    assert not [k for k in unchanged if ".experts." not in k], unchanged
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "checkpoint-8" / "model.safetensors"))
    bad = [k for k, v in saved.items() if not torch.equal(v, after[k])]
    assert sorted(saved) == sorted(after) and not bad, bad


def test_calibration_redecides_the_overflowing_node_inside_its_region():
    """Calibration runs per region, on the inputs each region received from the calibration batches: an expert whose
    fc2 overflows fp16 is refused without calibration (naming the region's node) and re-decided with it, that node
    only; the conversion's output is then finite and as close to fp32 as autocast's bf16 would be."""
    from converter.api import Fp16OverflowError

    mf = load("moe_dispatch")
    model = mf.build_model()
    with torch.no_grad():
        model.moe_layers[0].experts[1].fc2.weight.mul_(1e5)  # its outputs reach ~7e4 > 65504
    example = mf.example_inputs()
    gen = torch.Generator().manual_seed(11)
    batches = [mf._batch(gen) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Fp16OverflowError, match="fc2"):
            converter.convert(model, example, precision="fp16")
        conv = converter.convert(model, example, precision="fp16", calibration=batches,
                                 calibration_options={"progress": False})
    assert conv.graph_breaks, "the MoE dispatch loop is a graph break"
    changed = {name for name, d in conv.decisions.items() if d.rule.table == "calibration"}
    assert changed == {"moe_layers.0.experts.1/fc2"}, changed
    assert conv.decisions["moe_layers.0.experts.1/fc2"].precision in ("bf16", "fp32")
    region = next(r for r in conv.partition.regions if r.path == "moe_layers.0.experts.1")
    assert region.conversion.calibration, "the region was not calibrated on its own inputs"
    assert any(d.precision == "fp16" for d in conv.decisions.values()), "no node left in fp16"
    conv.module.eval()
    model.eval()
    with torch.no_grad():
        want = model(*example)[0]
        got = conv.module(*example)[0].float()
    assert bool(torch.isfinite(got).all()), "the calibrated conversion overflowed"
    db = sqnr(want, got)
    assert 25.0 <= db < HALF_CEILING_DB, f"calibrated fp16 partial conversion: {db:.1f} dB against fp32"


def test_the_accuracy_search_meets_the_tolerance_in_every_region():
    """calibration_options={"tolerance": ...} runs the accuracy search in each region, on that region's own inputs:
    every region meets it (some by keeping nodes in fp32), and the kept nodes are fp32 in the partial conversion."""
    mf = load("pabee")
    model = mf.build_model()
    example = mf.example_inputs()
    batches = [b for _, (b, _) in zip(range(3), mf.train_batches())]
    tolerance = 45.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, example, precision="fp16", calibration=batches,
                                 calibration_options={"progress": False, "tolerance": tolerance})
    assert conv.graph_breaks and len(conv.partition.regions) >= 4, conv.partition
    searches = {r.path: r.conversion.module.meta["mp_calibration"]["search"] for r in conv.partition.regions}
    not_met = {path: s.get("sqnr_db") for path, s in searches.items() if not s["met"] or float(s["sqnr_db"]) < tolerance}
    assert not not_met, f"regions under {tolerance} dB: {not_met}"
    kept = {f"{path}/{name}" for path, s in searches.items() for name in s["kept_fp32"]}
    assert all(conv.decisions[name].precision == "fp32" for name in kept), kept
    assert sum(d.precision == "fp16" for d in conv.decisions.values()) >= 4, "the search left nothing in fp16"

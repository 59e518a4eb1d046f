"""The model zoo (issue 14 items 7 and 8, issue 30 item 6): transformers architectures built from
small configs (nothing is downloaded) and hand-written models, see ``tests/zoo_models.py``.

For each model:

* the CLI exits 0 (``main([...])`` in-process; a real ``python -m converter`` subprocess for a few);
* the emitted ``model.py`` runs in a torch-only venv (one venv and one subprocess for the module)
  and reproduces ``conv.module`` bit for bit;
* the converted module (and the emitted model.py) runs at a second batch size and sequence length;
* ``train()``/``eval()`` behave as the original's: stochastic layers active only in train, eval
  deterministic and close to fp32;
* one :class:`converter.MixedPrecisionTrainer` step in fp16 O2 and in bf16 O1 gives finite fp32
  gradients;
* ``conv.module.state_dict()`` loads into the original class with ``strict=True`` and gives the
  original's fp32 outputs exactly;
* the parameter gradients of the bf16 and fp16 conversions (eval mode, one fixed fp32 loss) hold
  autocast's gradient SQNR against fp32 within 1 dB, with a cosine check on the whole gradient and
  on each parameter's (issue 30 item 6).

HF models are built with the library's defaults (SDPA attention where the model has it, caches on);
``*_eager`` entries add eager attention as a variant. Issue 30 added families for its patterns:
T5 with relative attention bias in fp16, MLA + MoE (DeepSeek-V3), DETR, weight-standardised convs,
a log-mel front end under ``autocast(enabled=False)``, custom autograd Functions (gradient reversal,
safe sqrt), parametrized convs (weight_norm, spectral_norm) and a Fourier neural operator (rfft, a
complex weight, irfft).

``test_zoo_table`` prints the table (architecture, tracer, CLI seconds, SQNR vs fp32 of the
conversion and of autocast in bf16 and fp16, for the outputs and for the parameter gradients, the
worst parameter's gradient cosine, dynamic shapes ok, modes ok) and writes it to ``zoo_table.md``
in the test's temporary directory (or to ``$MPCONVERT_ZOO_TABLE``).

Every model converts dynamically (batch and sequence/image dims) and follows train()/eval():
ConvNeXt and Swin (stochastic depth, a Python branch on self.training) as two graphs, Wav2Vec2
with its LayerDrop off in the train graph (reported), the LSTM/GRU model with a dynamic length.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_half_ran, first_tensor, sqnr, torch_only_python
from zoo_models import HF_CLASSES, ZOO, build, build_inputs, hf_config, second_size

import converter
from converter.cli.main import main as cli_main

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TESTS = Path(__file__).resolve().parent
#: MPCONVERT_ZOO_MODELS=llama,fno runs the module (its CLI and venv fixtures included) on those models only
NAMES = [n for n in ZOO if n in os.environ["MPCONVERT_ZOO_MODELS"].split(",")] if os.environ.get(
    "MPCONVERT_ZOO_MODELS") else list(ZOO)
#: run as a real `python -m converter` subprocess (the others call cli.main in-process: same code, no start-up)
SUBPROCESS_CLI = {"gpt2", "lstm_gru", "groupnorm_unet"}

#: models whose emitted model.py needs the library that defines a custom op they call (report.json's
#: library_ops): in the torch-only venv it must fail with one clear line naming the package, and with
#: the package installed it must run bit-identically (checked in this process)
NEEDS = {"mixtral": "transformers", "deepseek_v3": "transformers"}

#: converted with dynamic=False (CLI --static); none since Swin captures a dynamic batch in seconds
STATIC: set[str] = set()


def _run(module, args, kwargs, *, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    return first_tensor(module(*args, **kwargs)).float()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


# ---------------------------------------------------------------------------------------------
# conversions and numerics (cached per model: every test of a model shares them)


@functools.cache
def _case(name: str) -> dict:
    """The model, its example, fp32/autocast references and the bf16 (O1) and fp16 (O2) conversions."""
    model, (args, kwargs) = build(name)
    with torch.no_grad():
        ref = _run(model, args, kwargs)
    amp_bf16 = _autocast(model, args, kwargs, torch.bfloat16)
    dynamic = name not in STATIC
    bf16 = converter.convert(model, (args, kwargs), precision="bf16", dynamic=dynamic)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny fp16 GEMMs on this CPU are far faster on one thread (conftest.one_thread)
    try:
        amp_fp16 = _autocast(model, args, kwargs, torch.float16)
        fp16 = converter.convert(model, (args, kwargs), precision="fp16", opt_level="O2", dynamic=dynamic)
        with torch.no_grad():
            out_fp16 = _run(fp16.module, args, kwargs)
    finally:
        torch.set_num_threads(previous)
    with torch.no_grad():
        out_bf16 = _run(bf16.module, args, kwargs)
    return {
        "model": model, "args": args, "kwargs": kwargs, "ref": ref, "bf16": bf16, "fp16": fp16,
        "out_bf16": out_bf16,
        "sqnr": {"bf16": sqnr(ref, out_bf16), "amp_bf16": None if amp_bf16 is None else sqnr(ref, amp_bf16),
                 "fp16": sqnr(ref, out_fp16), "amp_fp16": None if amp_fp16 is None else sqnr(ref, amp_fp16)},
    }


def _autocast(model, args, kwargs, dtype) -> torch.Tensor | None:
    """The original under torch.autocast, or None where autocast itself fails: on this CPU fp16
    autocast has no LSTM kernel (oneDNN), and a masked_fill(finfo(fp32).min) on an autocast bf16
    einsum overflows (the very failure issue 14 item 4 fixes in the converter)."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            return _run(model, args, kwargs)
    except RuntimeError:
        return None


#: fp16 gradients are taken with a loss scale (the converted module and autocast alike), as a
#: trainer would: tiny models' parameter gradients sit near fp16's subnormals otherwise. It starts
#: here and halves while a gradient is not finite, as a dynamic loss scaler does (DETR's decoder
#: overflows fp16 at 1024 under autocast too)
FP16_LOSS_SCALE = 1024.0
#: gradient floors: the conversion's gradient SQNR may trail autocast's by this much; the cosine of
#: the flattened gradient and of every parameter's gradient against fp32's (a sign flip fails)
GRAD_MARGIN_DB = 1.0
GRAD_MIN_COS = 0.99
PARAM_MIN_COS = 0.9


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


@contextlib.contextmanager
def _kept_in_fp32(model, dtype):
    """Autocast given the model's own precision intent, as the conversion honours it: transformers'
    ``_keep_in_fp32_modules`` (fp16 only; ``_strict`` for bf16 too) run with autocast off on fp32 inputs.
    Plain autocast runs T5's ``wo`` in fp16, and an fp32 ``wo`` changes the gradients upstream of it
    (T5 fp16: 49.8 dB with wo in fp32, for the conversion and for autocast alike, 56.8 dB all fp16), so
    the baseline must run the same plan."""
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    chosen = [m for name, m in model.named_modules() if name and any(name.split(".")[-1] == k for k in keep)]

    def fp32_forward(inner):
        def forward(*args, **kwargs):
            cast = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            with torch.autocast("cpu", enabled=False):
                return inner(*cast, **kwargs)
        return forward

    for m in chosen:
        m.forward = fp32_forward(m.forward)
    try:
        yield
    finally:
        for m in chosen:
            del m.forward


def _param_grads(module, args, kwargs, proj, *, autocast=None, scale=1.0) -> dict[str, torch.Tensor]:
    """name -> float64 gradient of ``sum(output * proj) * scale`` / scale (fp32 loss) for every
    parameter that requires grad and gets one; eval mode, so that no dropout RNG is involved. With
    ``scale`` != 1 the scale halves (down to 2**-10: DETR's fp32 gradients exceed fp16's range) while
    a gradient is not finite."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    while True:
        torch.manual_seed(0)
        with (torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()), \
                (_kept_in_fp32(module, autocast) if autocast is not None else contextlib.nullcontext()):
            out = first_tensor(module(*args, **kwargs))
        loss = (out.float() * proj).sum() * scale
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        if scale <= 2.0 ** -10 or all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            return {n: _real(g.detach()).double() / scale for (n, _), g in zip(named, grads) if g is not None}
        scale /= 2


def _compare_grads(ref: dict, got: dict) -> dict:
    """SQNR and cosine of the flattened gradient of every parameter in both; the worst parameter's
    cosine and SQNR; parameters only one side has. The per-parameter cosine skips gradients that are
    zero up to fp32 rounding (norm < 1e-6 of the largest: BERT's key biases, whose exact gradient is 0)."""
    names = [n for n in ref if n in got]
    r = torch.cat([ref[n].reshape(-1) for n in names])
    o = torch.cat([got[n].reshape(-1) for n in names])
    largest = max((float(ref[n].norm()) for n in names), default=0.0)
    per_cos = {n: float(torch.nn.functional.cosine_similarity(ref[n].reshape(-1), got[n].reshape(-1), dim=0))
               for n in names if float(ref[n].norm()) > 1e-6 * largest}
    per_sqnr = {n: sqnr(ref[n], got[n]) for n in per_cos}
    worst_cos = min(per_cos.items(), key=lambda kv: kv[1], default=(None, 1.0))
    worst_sqnr = min(per_sqnr.items(), key=lambda kv: kv[1], default=(None, float("inf")))
    return {"sqnr": sqnr(r, o), "cos": float(torch.nn.functional.cosine_similarity(r, o, dim=0)),
            "min_cos": worst_cos, "min_sqnr": worst_sqnr,
            "missing": sorted(set(ref) - set(got)), "extra": sorted(set(got) - set(ref))}


@functools.cache
def _grads(name: str) -> dict:
    """Parameter gradients of the cached bf16 (O1) and fp16 (O2) conversions and of autocast on the
    original, each against the fp32 original's, for one fixed scalar loss (eval mode)."""
    case = _case(name)
    model, args, kwargs = case["model"], case["args"], case["kwargs"]
    proj = torch.randn(case["ref"].shape, generator=torch.Generator().manual_seed(sum(map(ord, name)) + 7))
    ref = _param_grads(model, args, kwargs, proj)
    result = {}
    previous = torch.get_num_threads()
    for dtype, half in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        scale = FP16_LOSS_SCALE if dtype == "fp16" else 1.0
        if dtype == "fp16":
            torch.set_num_threads(1)  # tiny fp16 GEMMs on this CPU (conftest.one_thread)
        try:
            try:
                amp = _compare_grads(ref, _param_grads(model, args, kwargs, proj, autocast=half, scale=scale))
            except RuntimeError:  # autocast itself fails on this model (see _autocast)
                amp = None
            try:
                got = _compare_grads(ref, _param_grads(case[dtype].module, args, kwargs, proj, scale=scale))
            except Exception as exc:  # recorded for the table; the test asserts on it
                got = {"error": _short(exc)}
        finally:
            torch.set_num_threads(previous)
        result[dtype], result["amp_" + dtype] = got, amp
    return result


@functools.cache
def _second(name: str) -> dict:
    """conv.module at a second batch size and length against the fp32 model there."""
    case = _case(name)
    batch, length = second_size(name)
    args, kwargs = build_inputs(name, batch=batch, length=length)
    with torch.no_grad():
        ref = _run(case["model"], args, kwargs)
        try:
            out = _run(case["bf16"].module, args, kwargs)
        except Exception as exc:  # recorded for the table; the test asserts on it
            return {"error": _short(exc), "inputs": (args, kwargs)}
    return {"error": None, "sqnr": sqnr(ref, out), "shape": tuple(out.shape), "ref_shape": tuple(ref.shape),
            "inputs": (args, kwargs), "ref": ref}


def _stochastic(module, args, kwargs) -> bool:
    with torch.no_grad():
        first = _run(module, args, kwargs, seed=1)
        return any(not torch.equal(first, _run(module, args, kwargs, seed=seed)) for seed in (2, 3, 4))


def _bn_stats(module) -> list[torch.Tensor]:
    return [b.detach().clone() for n, b in module.named_buffers() if n.endswith("running_mean")]


@functools.cache
def _modes(name: str) -> dict:
    """train()/eval() on a copy of conv.module, compared with the original's behaviour."""
    case = _case(name)
    args, kwargs = case["args"], case["kwargs"]
    original = copy.deepcopy(case["model"]).train()
    want_stochastic = _stochastic(original, args, kwargs)
    before = _bn_stats(original)
    with torch.no_grad():
        original(*args, **kwargs)
    want_bn_update = any(not torch.equal(a, b) for a, b in zip(before, _bn_stats(original)))
    try:
        fresh = copy.deepcopy(case["bf16"].module)
        fresh.train()
        fresh.eval()  # back to eval before any train forward: the statistics are still the original's
        frozen = _bn_stats(fresh)
        with torch.no_grad():
            e1, e2 = _run(fresh, args, kwargs, seed=1), _run(fresh, args, kwargs, seed=2)
        eval_bn_frozen = all(torch.equal(a, b) for a, b in zip(frozen, _bn_stats(fresh)))
        module = copy.deepcopy(case["bf16"].module)
        module.train()
        got_stochastic = _stochastic(module, args, kwargs)
        before = _bn_stats(module)
        with torch.no_grad():
            module(*args, **kwargs)
        got_bn_update = any(not torch.equal(a, b) for a, b in zip(before, _bn_stats(module)))
    except Exception as exc:  # recorded for the table; the test asserts on it
        return {"error": _short(exc)}
    problems = []
    if want_stochastic != got_stochastic:
        problems.append(f"train(): stochastic {got_stochastic}, the original {want_stochastic}")
    if want_bn_update != got_bn_update:
        problems.append(f"train(): batch-norm statistics updated {got_bn_update}, the original {want_bn_update}")
    if not torch.equal(e1, e2):
        problems.append("eval(): two forwards differ")
    if not eval_bn_frozen:
        problems.append("eval(): batch-norm statistics changed")
    eval_sqnr = sqnr(case["ref"], e1)
    if eval_sqnr < 30:
        problems.append(f"eval(): SQNR {eval_sqnr:.1f} dB against the fp32 eval output")
    return {"error": "; ".join(problems) or None, "stochastic": want_stochastic, "bn": want_bn_update}


# ---------------------------------------------------------------------------------------------
# the CLI and the torch-only venv


_MODEL_FILE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from zoo_models import build_inputs, build_model as _build_model


    def build_model():
        return _build_model({name!r})


    def example_inputs():
        return build_inputs({name!r})
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def cli_runs(workdir) -> dict:
    """name -> (exit status, seconds, stderr, output dir) of `mpconvert MODEL.py --out DIR`."""
    runs = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in NAMES:
        path = workdir / f"{name}.py"
        path.write_text(_MODEL_FILE.format(tests=str(TESTS), name=name))
        out = workdir / f"{name}_mp"
        argv = [str(path), "--out", str(out), "--quiet", "--no-measure", *(["--static"] if name in STATIC else [])]
        start = time.perf_counter()
        if name in SUBPROCESS_CLI:
            proc = subprocess.run([sys.executable, "-m", "converter", *argv, "--device-profile", "none"], capture_output=True, text=True,
                                  env=env, cwd=workdir, timeout=300)
            code, err = proc.returncode, proc.stderr
        else:
            buf = io.StringIO()
            with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(argv)
            err = buf.getvalue()
        runs[name] = (code, time.perf_counter() - start, err, out)
    return runs


_STANDALONE = textwrap.dedent(
    """
    import importlib.util, sys, traceback
    for banned in ("converter", "transformers", "numpy"):
        assert importlib.util.find_spec(banned) is None, banned + " is importable in the torch-only venv"
    import torch

    def main_tensor(out):
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, dict):
            return out["logits"] if "logits" in out else next(iter(out.values()))
        return main_tensor(out[0])

    jobs = torch.load(sys.argv[1], weights_only=True)
    results = {}
    for name, (model_py, example, second) in jobs.items():
        try:
            spec = importlib.util.spec_from_file_location("emitted_" + name, model_py)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.load()
            with torch.no_grad():
                results[name] = main_tensor(model(*example[0], **example[1]))
        except Exception as exc:
            results[name] = "error: " + traceback.format_exc(limit=-2)
            continue
        if second is None:
            results[name + ".second"] = "not run: conv.module fails at the second size"
            continue
        try:
            with torch.no_grad():
                results[name + ".second"] = main_tensor(model(*second[0], **second[1]))
        except Exception as exc:
            results[name + ".second"] = "error: " + type(exc).__name__ + ": " + str(exc).strip().splitlines()[0][:200]
    torch.save(results, sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def standalone(cli_runs, workdir) -> dict:
    """name -> output of the emitted model.py on the example (and name.second on the second size),
    run by one subprocess in the torch-only venv."""
    python = torch_only_python(workdir)
    jobs = {}
    for name, (code, _s, _e, out) in cli_runs.items():
        if code == 0:
            # only where conv.module accepts the second size: with the example's shapes baked in, the
            # emitted code can crash the process (aten.lstm with a batch-2 h0 at batch 3 segfaults)
            try:
                second = _second(name)["inputs"] if _second(name)["error"] is None else None
            except Exception:  # noqa: BLE001 - conversion fails in-process: that model's own tests say so;
                second = None  # its model.py (and every other model's) still runs here
            jobs[name] = (str(out / "model.py"), build_inputs(name), second)
    torch.save(jobs, workdir / "jobs.pt")
    (workdir / "standalone.py").write_text(_STANDALONE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    proc = subprocess.run([python, "-I", str(workdir / "standalone.py"), str(workdir / "jobs.pt"), str(workdir / "out.pt")],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(workdir / "out.pt", weights_only=True)


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("name", NAMES)
def test_cli_converts_and_emits(name, cli_runs):
    code, seconds, err, out = cli_runs[name]
    assert code == 0, f"{name}: mpconvert exited {code} after {seconds:.1f}s: {err.strip()[-600:]}"
    assert {"model.py", "train.py", "report.json"} <= {p.name for p in out.iterdir()}, sorted(out.iterdir())


def _emitted_here(name: str, cli_runs: dict, inputs) -> torch.Tensor:
    """The emitted model.py of ``name`` run in this process (where every library is importable)."""
    spec = importlib.util.spec_from_file_location(f"zoo_here_{name}", cli_runs[name][3] / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.no_grad():
        return first_tensor(module.load()(*inputs[0], **inputs[1]))


@pytest.mark.parametrize("name", NAMES)
def test_emitted_model_runs_in_a_torch_only_venv(name, standalone, cli_runs):
    got = standalone.get(name, "not emitted")
    if name in NEEDS:
        package = NEEDS[name]
        assert isinstance(got, str) and f"which the package '{package}' defines: pip install {package}" in got, got
        assert _case(name)["bf16"].report.records.lowering.library_ops, "the report lists no library op"
        got = _emitted_here(name, cli_runs, build_inputs(name))
    assert isinstance(got, torch.Tensor), f"{name}: {got}"
    want = _case(name)["out_bf16"]
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.float(), want), f"{name}: max |diff| {(got.double() - want.double()).abs().max().item()}"


@pytest.mark.parametrize("name", NAMES)
def test_second_batch_size_and_length(name):
    _half_ran(name, "bf16")
    second = _second(name)
    assert second["error"] is None, f"{name}: {second['error']}"
    assert second["shape"] == second["ref_shape"], second
    assert second["sqnr"] >= 30, f"{name}: SQNR {second['sqnr']:.1f} dB at {second_size(name)}"


@pytest.mark.parametrize("name", NAMES)
def test_emitted_model_runs_at_a_second_size(name, standalone, cli_runs):
    got = standalone.get(name + ".second", "not emitted")
    if name in NEEDS:
        got = _emitted_here(name, cli_runs, _second(name)["inputs"])
    assert isinstance(got, torch.Tensor), f"{name}: {got}"
    _half_ran(name, "bf16")  # model.py is the bf16 conversion's (bit for bit: test_emitted_model_runs_in_a_torch_only_venv)
    ref = _second(name).get("ref")
    assert ref is not None and got.shape == ref.shape, (got.shape, None if ref is None else ref.shape)
    s = sqnr(ref, got.float())
    assert s >= 30, f"{name}: emitted model.py SQNR {s:.1f} dB at {second_size(name)}"


@pytest.mark.parametrize("name", NAMES)
def test_train_and_eval_modes(name):
    _half_ran(name, "bf16")  # the modes' eval SQNR floor holds for a conversion in half
    modes = _modes(name)
    assert modes["error"] is None, f"{name}: {modes['error']}"


def _trainer_step(conv, args, kwargs, *, precision: str, master_weights: bool) -> tuple[bool, list]:
    """One step; fp16 starts at loss scale 1024 and, where that step is skipped (DETR's gradients
    overflow fp16 at 1024 under autocast too), tries again at a quarter of it, as a dynamic scaler would."""
    for scale in (1024.0, 256.0, 64.0, 16.0, 4.0, 1.0) if precision == "fp16" else ("dynamic",):
        module = copy.deepcopy(conv.module)
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
        trainer = converter.MixedPrecisionTrainer(module, optimizer, precision=precision,
                                                  master_weights=master_weights, loss_scale=scale)
        trainer.zero_grad()
        loss = _run(module, args, kwargs).pow(2).mean()
        trainer.backward(loss)
        stepped = trainer.step()
        if stepped:
            break
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return stepped, grads


@pytest.mark.parametrize("name", NAMES)
def test_one_trainer_step_fp16_o2_and_bf16_o1(name, one_thread):
    case = _case(name)
    for precision, master in (("fp16", True), ("bf16", False)):
        stepped, grads = _trainer_step(case[precision], case["args"], case["kwargs"], precision=precision,
                                       master_weights=master)
        label = f"{name} {precision} {'O2' if master else 'O1'}"
        assert stepped, f"{label}: the step was skipped (non-finite gradients)"
        assert grads, f"{label}: no gradients"
        bad = [g.dtype for g in grads if g.dtype not in (torch.float32, torch.complex64)]  # complex: FNO's weights
        assert not bad, f"{label}: gradient dtypes {set(bad)}"
        assert all(torch.isfinite(g).all() for g in grads), f"{label}: non-finite gradients"
        assert any(g.abs().sum() > 0 for g in grads), f"{label}: all gradients are zero"


#: the output SQNR against fp32 may trail autocast's (on the same model and inputs) by this much, and must reach
#: the floor where autocast itself fails; OUTPUT_MARGIN_DB_FOR names the models that trail by more, measured.
#: Measured (conversion - autocast): resnet bf16 -3.0, swin fp16 -2.7, convnext fp16 -2.3, albert bf16 -2.2 dB,
#: every other model within 2 dB or ahead; the floors: bf16 >= 39.0 dB (unet2d), fp16 >= 57.3 dB (unet2d)
OUTPUT_MARGIN_DB = 3.5
OUTPUT_MARGIN_DB_FOR = {("albert", "fp16"): 6.0}  # 63.4 vs autocast's 68.5 dB: ALBERT's one shared layer, 12 times
OUTPUT_FLOOR_DB = {"bf16": 35.0, "fp16": 50.0}
#: the share of the FLOPs that must run in half (report.summary.half_flop_fraction); measured on the 47 models:
#: 0.82 at least (T5 in fp16, whose _keep_in_fp32_modules `wo` stays fp32), 0.91 mel_frontend (its log-mel front end
#: under autocast(enabled=False)), >= 0.96 for the others; a conversion left in fp32 has 0
HALF_SHARE = 0.8


def _half_ran(name: str, dtype: str) -> float:
    return assert_half_ran(_case(name)[dtype], min_share=HALF_SHARE, label=f"{name} {dtype}")


@pytest.mark.parametrize("name", NAMES)
def test_numerics_against_fp32_and_autocast(name):
    """Output SQNR against fp32 of the bf16 (O1) and fp16 (O2) conversions, at least autocast's minus a margin
    (autocast measured here, on the same inputs), and half precision ran (the report's half-FLOP share)."""
    s = _case(name)["sqnr"]
    for dtype in ("bf16", "fp16"):
        share = _half_ran(name, dtype)
        amp = s["amp_" + dtype]
        label = f"{name} {dtype}: SQNR {s[dtype]:.1f} dB, autocast {_fmt(amp)} dB, {100 * share:.0f}% of FLOPs in half"
        assert s[dtype] >= OUTPUT_FLOOR_DB[dtype], f"{label}: < the floor {OUTPUT_FLOOR_DB[dtype]} dB"
        if amp is not None:
            margin = OUTPUT_MARGIN_DB_FOR.get((name, dtype), OUTPUT_MARGIN_DB)
            assert s[dtype] >= amp - margin, f"{label}: trails autocast by more than {margin} dB"


@pytest.mark.parametrize("name", NAMES)
def test_gradients_against_fp32_and_autocast(name):
    """Parameter gradients of the bf16 and fp16 conversions against the fp32 original's: SQNR at
    least autocast's - GRAD_MARGIN_DB, and the cosine of the whole gradient and of each parameter's
    (a gradient that lost its custom backward, sign-flipped or NaN, fails here)."""
    grads = _grads(name)
    for dtype in ("bf16", "fp16"):
        _half_ran(name, dtype)
        got, amp = grads[dtype], grads["amp_" + dtype]
        label = f"{name} {dtype}"
        assert "error" not in got, f"{label}: the backward fails: {got.get('error')}"
        assert not got["missing"] and not got["extra"], (
            f"{label}: parameters with a gradient only in fp32 {got['missing'][:5]} / only converted {got['extra'][:5]}")
        amp_text = "autocast fails" if amp is None else (
            f"autocast {_fmt(amp['sqnr'])} dB, cos {amp['cos']:.4f}, worst parameter cos {amp['min_cos'][1]:.3f}")
        detail = (f"gradient SQNR {_fmt(got['sqnr'])} dB, cos {got['cos']:.4f}, worst parameter {got['min_cos'][0]} "
                  f"cos {got['min_cos'][1]:.3f} ({amp_text})")
        assert got["cos"] >= GRAD_MIN_COS, f"{label}: {detail}: cosine < {GRAD_MIN_COS}"
        assert got["min_cos"][1] >= PARAM_MIN_COS, f"{label}: {detail}: a parameter's cosine < {PARAM_MIN_COS}"
        if amp is not None:
            floor = amp["sqnr"] - GRAD_MARGIN_DB
            assert got["sqnr"] >= floor, f"{label}: {detail}: SQNR < autocast - {GRAD_MARGIN_DB} dB"


@pytest.mark.parametrize("name", NAMES)
def test_weights_round_trip_into_the_original_class(name):
    """conv.module.state_dict() loads strictly into a fresh instance of the original class."""
    case = _case(name)
    state = case["bf16"].module.state_dict()
    assert set(state) == set(case["model"].state_dict()), "state_dict keys differ from the original's"
    torch.manual_seed(12345)  # a fresh instance with other weights
    if name in HF_CLASSES:
        fresh = getattr(transformers, HF_CLASSES[name])(hf_config(name)).eval()
    else:
        fresh = type(case["model"])().eval()
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        out = _run(fresh, case["args"], case["kwargs"])
    assert torch.equal(out, case["ref"]), f"{name}: max |diff| {(out - case['ref']).abs().max().item()}"


@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_trained_weights_go_back_to_save_pretrained(master_weights, tmp_path):
    """The README recipe: train the converted module, load its state dict (O2: with the fp32 masters)
    into the HF class, save_pretrained, from_pretrained."""
    case = _case("bert")
    assert_half_ran(case["bf16"], min_share=HALF_SHARE, label="bert bf16")
    module = copy.deepcopy(case["bf16"].module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    trainer = converter.MixedPrecisionTrainer(module, optimizer, precision="bf16", master_weights=master_weights)
    for _ in range(2):
        trainer.zero_grad()
        trainer.backward(_run(module, case["args"], case["kwargs"]).pow(2).mean())
        assert trainer.step()
    state = module.state_dict()
    if master_weights:
        ckpt = trainer.state_dict()
        assert ckpt["master"], "O2 kept no fp32 masters"
        assert all(state[k].dtype == torch.bfloat16 for k in ckpt["master"]), "O2 module parameters are not half"
        state = {**ckpt["model"], **ckpt["master"]}
    hf_model = transformers.BertForSequenceClassification(hf_config("bert"))
    hf_model.load_state_dict(state, strict=True)
    hf_model.save_pretrained(tmp_path / "trained")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "trained").eval()
    changed = [k for k, v in case["model"].state_dict().items() if v.is_floating_point() and not torch.equal(v, state[k].float())]
    assert changed, "training changed no weight"
    for key, value in reloaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, state[key]), key
    with torch.no_grad():
        got = _run(reloaded, case["args"], case["kwargs"])
        want = _run(hf_model.eval(), case["args"], case["kwargs"])
        trained = _run(module, case["args"], case["kwargs"])
    assert torch.equal(got, want)
    assert sqnr(want, trained) >= 30, f"the converted module drifted from its own weights: {sqnr(want, trained):.1f} dB"


def _fmt(value) -> str:
    if value is None:
        return "fails"
    return "inf" if value == float("inf") else f"{value:.1f}"


def _grad_cell(stats) -> str:
    if stats is None:
        return "fails"
    return f"fails: {stats['error'][:50]}" if "error" in stats else _fmt(stats["sqnr"])


def _cos_cell(stats) -> str:
    return "-" if stats is None or "error" in stats else f"{stats['min_cos'][1]:.3f}"


def test_zoo_table(cli_runs, workdir):
    """Prints (and writes) the zoo table; fails if a model does not convert, and (after writing the table) if a
    conversion's cell fails: the CLI, the second size, train/eval, a backward, or half precision that did not run."""
    header = ("| model | family | tracer | CLI s | bf16 dB | autocast bf16 dB | fp16 dB | autocast fp16 dB "
              "| grad bf16 dB | autocast grad bf16 dB | grad fp16 dB | autocast grad fp16 dB | worst param cos bf16 / fp16 "
              "| dynamic shapes | train/eval |")
    rows = [header, "|" + "---|" * 15]
    problems = []
    for name in NAMES:
        code, seconds, _err, _out = cli_runs[name]
        case = _case(name)  # a model that does not convert fails the table (its own tests say more)
        s = case["sqnr"]
        second, modes = _second(name), _modes(name)
        dyn = "ok" if second["error"] is None and second["sqnr"] >= 30 else f"no ({(second['error'] or '')[:60]})"
        mode = "ok" if modes["error"] is None else f"no ({modes['error'][:60]})"
        cli = f"{seconds:.1f}" + ("" if code == 0 else f" (exit {code})")
        grads = _grads(name)
        problems += [f"{name}: {what}" for what, bad in (
            (f"CLI exit {code}", code != 0), (f"second size: {dyn}", dyn != "ok"), (f"train/eval: {mode}", mode != "ok"),
            *((f"{d} gradients: {grads[d].get('error')}", "error" in grads[d]) for d in ("bf16", "fp16")),
            *((f"{d}: {100 * case[d].report.summary['half_flop_fraction']:.0f}% of FLOPs in half",
               case[d].report.summary["half_flop_fraction"] < HALF_SHARE) for d in ("bf16", "fp16"))) if bad]
        rows.append(f"| {name} | {ZOO[name]} | {case['bf16'].tracer} | {cli} | {_fmt(s['bf16'])} | {_fmt(s['amp_bf16'])} "
                    f"| {_fmt(s['fp16'])} | {_fmt(s['amp_fp16'])} | {_grad_cell(grads['bf16'])} "
                    f"| {_grad_cell(grads['amp_bf16'])} | {_grad_cell(grads['fp16'])} | {_grad_cell(grads['amp_fp16'])} "
                    f"| {_cos_cell(grads['bf16'])} / {_cos_cell(grads['fp16'])} | {dyn} | {mode} |")
    table = "\n".join(rows) + "\n"
    path = Path(os.environ.get("MPCONVERT_ZOO_TABLE", workdir / "zoo_table.md"))
    path.write_text(table)
    print("\n" + table)
    assert len(rows) == len(NAMES) + 2
    assert not problems, f"{len(problems)} cells of the zoo table fail: " + "; ".join(problems)

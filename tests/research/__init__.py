"""The research-style models (one model file each, see README.md) and how their numerics are measured.

``tests/test_partial.py`` asserts with these helpers and ``benchmarks/partial.py --table`` records with them, so the
figures in docs/partial.md are the ones the tests check.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import statistics
from pathlib import Path
from types import ModuleType

import torch

from converter.numerics.common import sqnr_db

RESEARCH = Path(__file__).resolve().parent
NAMES = tuple(sorted(p.stem for p in RESEARCH.glob("*.py") if p.stem != "__init__"))

#: batches the numerics are measured on, each on its own: a research model's output is small (a few logits per
#: example), and a discrete choice (ACT's halting step, an NMS keep) that flips on one batch moves its SQNR by
#: far more than rounding does; the median over the batches is the rounding's
BATCHES = 5


def load(name: str) -> ModuleType:
    """The model file ``tests/research/NAME.py``, imported as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"research_{name}", RESEARCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_call(example) -> tuple[tuple, dict]:
    """A model file's ``example_inputs()`` as (args, kwargs)."""
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], tuple) and isinstance(example[1], dict):
        return example
    return tuple(example), {}


def floats(value) -> list[torch.Tensor]:
    """The floating tensors of a (nested) output, in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in floats(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floats(v)]
    return []


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def outputs_and_grads(module: torch.nn.Module, mf, *, autocast: str = "") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per training batch (the first BATCHES; their sizes need not be the example's): the outputs and the parameter
    gradients (named_parameters order, zeros where unused) of an eval-mode step."""
    module.eval()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)
    found = []
    for _, (args, batch) in zip(range(BATCHES), mf.train_batches()):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            out = module(*args)
            loss = mf.loss_fn(out, batch)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in module.named_parameters()]
        found.append((flat(floats(out)), flat(grads)))
    return found


def against_autocast(mf, module: torch.nn.Module, precision: str) -> dict[str, float]:
    """The medians over the batches of the output and parameter-gradient SQNR against fp32 (``mf.build_model()``), of
    ``module`` and of torch.autocast in ``precision``: ``output_db``, ``autocast_output_db``, ``grad_db``,
    ``autocast_grad_db``."""
    ref = outputs_and_grads(mf.build_model(), mf)
    auto = outputs_and_grads(mf.build_model(), mf, autocast=precision)
    ours = outputs_and_grads(module, mf)  # a model captured whole converts the batches' other sizes again
    return {"output_db": median_sqnr(ref, ours, 0), "autocast_output_db": median_sqnr(ref, auto, 0),
            "grad_db": median_sqnr(ref, ours, 1), "autocast_grad_db": median_sqnr(ref, auto, 1)}


def median_sqnr(ref: list, got: list, index: int) -> float:
    """The median over the batches of the SQNR of output (``index`` 0) or gradients (1); a batch whose output differs
    in size (NMS kept another box count) counts as -inf, a flip."""
    return statistics.median(sqnr_db(r[index], g[index]) if r[index].shape == g[index].shape else -math.inf
                             for r, g in zip(ref, got))

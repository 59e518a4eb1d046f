"""One eager forward that tells capture what no tracer can see (part of *capture*).

A tracer runs the model's Python once and records the tensor ops. Three things it cannot record,
and bakes into the graph instead, silently:

* **Python-side randomness**: ``random.random()``, ``numpy.random`` (fairseq's LayerDrop,
  ``if self.training and random.random() < p: continue``): one draw becomes a constant;
* **module state that forward writes**: attributes, counters, lists, memo dicts
  (``self.calls += 1``, ``self.last_norm = float(...)``): the write is lost and the value read is
  frozen at trace time;
* values computed from those (a temperature annealed from a step counter).

:func:`probe` runs the model once, eagerly, on a :func:`~converter.passes.capture.shells.shell`
(so the user's modules keep their attributes), in train mode (what capture traces), under
``no_grad`` with every RNG put back afterwards, and records per module (by its dotted path):

* ``impurity``: why a capture of that module would bake something in (it drew Python/numpy random
  numbers during its call, or wrote one of its own attributes), or nothing;
* ``flops``: the FLOPs its calls ran (``torch.utils.flop_counter``, inclusive of its children);
* ``calls``: how often it was called, and (``record=True``) the inputs of its first call, which
  partial capture converts it on.

A module is impure when any module it contains is (a capture of it would contain the draw).
Probing never raises for the model's sake: a forward that fails eagerly here (a model on the meta
device whose ops have no meta kernel) returns None, and capture goes on as without it.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from converter.ir.state import preserved_state
from converter.passes.capture.advice import user_location
from converter.passes.capture.shells import shell

__all__ = ["Probe", "ModuleProbe", "Impurity", "probe", "attribute_fingerprint"]

#: what a module's ``__dict__`` holds that is torch's bookkeeping, not the user's state
_TORCH_TABLES = frozenset(vars(torch.nn.Module())) | {"forward"}


@dataclass(frozen=True)
class Impurity:
    """Why capturing a module would bake something in: its call drew Python-side random numbers (``kind``
    ``"random"``, ``source`` the generator) or wrote its own attributes (``"state"``, ``written``); ``origin`` is the
    module whose own code does it (an ancestor's capture would contain it)."""

    kind: str
    origin: str
    source: str = ""
    written: tuple[str, ...] = ()

    def reason(self, path: str) -> str:
        """The one phrase a graph break of the module at ``path`` reports."""
        if self.kind == "random":
            what = f"draws Python-side random numbers ({self.source}), which a captured graph would bake in as one draw"
        else:
            shown = ", ".join(f"self.{name}" for name in self.written[:3])
            what = f"forward writes module state ({shown}), which a captured graph would not write"
        return what if self.origin == path else f"contains {self.origin}, which {what}"


@dataclass
class ModuleProbe:
    """What the eager forward saw of one module (see the module docstring)."""

    path: str
    module_type: str
    calls: int = 0
    flops: int = 0
    #: the FLOPs of its calls in eval mode (recording only): a module train mode skipped still has a size
    eval_flops: int = 0
    #: why capturing this module would bake something in (None when nothing)
    impurity: Optional[Impurity] = None
    #: the user's ``file:line`` that made its first call (the innermost frame outside torch and this package)
    call_site: str = ""
    #: the (args, kwargs) of its first call on the example, when recorded
    inputs: Optional[tuple] = None
    #: the (args, kwargs) of its first call on each of the other batches, when recorded
    batch_inputs: list = field(default_factory=list)


@dataclass
class Probe:
    """The eager forward's findings, by module path ("" is the root)."""

    modules: dict[str, ModuleProbe] = field(default_factory=dict)

    @property
    def total_flops(self) -> int:
        root = self.modules.get("")
        return root.flops if root is not None else 0

    def impure(self, path: str) -> Optional[Impurity]:
        found = self.modules.get(path)
        return found.impurity if found is not None else None


def attribute_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """A comparable picture of ``module``'s own plain attributes (not parameters, buffers or submodules):
    scalars by value, containers by identity and length (an append is a write), anything else by identity."""
    picture: dict[str, tuple[Any, ...]] = {}
    for name, value in vars(module).items():
        if name in _TORCH_TABLES:
            continue
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            picture[name] = ("value", value)
        elif isinstance(value, (list, dict, set)):
            picture[name] = ("container", id(value), len(value))
        elif isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str, type(None))) for v in value):
            picture[name] = ("value", value)
        else:
            picture[name] = ("object", id(value))
    return picture


def _written(before: dict, after: dict) -> list[str]:
    return sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))


def _is_torch_module(module: torch.nn.Module) -> bool:
    return type(module).__module__.split(".", 1)[0] == "torch"


def _is_library_module(module: torch.nn.Module) -> bool:
    """A module whose class an installed package defines (transformers, diffusers...), not the user's own code."""
    source = getattr(sys.modules.get(type(module).__module__), "__file__", None) or ""
    return "site-packages" in source or "dist-packages" in source


def _numpy_state() -> Any:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    state = np.random.get_state()
    return (int(state[2]), state[1].tobytes(), state[3], state[4])


def _rng_state() -> tuple:
    return random.getstate(), _numpy_state()


def probe(model: torch.nn.Module, args: tuple, kwargs: dict, *, record: bool = False,
          batches: Optional[list] = None) -> Optional[Probe]:
    """Run ``model`` once eagerly and return what it saw (see the module docstring); None if the eager
    forward fails here. ``record``: keep each module's first-call inputs (``batches``: also for each of
    these (args, kwargs) pairs, into ``ModuleProbe.batch_inputs``)."""
    copy = shell(model)
    paths = {id(m): path for path, m in copy.named_modules()}
    found = {path: ModuleProbe(path, type(m).__name__) for path, m in copy.named_modules()}
    counter = FlopCounterMode(display=False)
    stack: list[tuple] = []
    runs: list[dict] = []
    counting = [0]  # which run: 0 train mode on the example (calls and FLOPs count), 1 eval mode, then the batches

    def before(module, call_args, call_kwargs):
        path = paths.get(id(module))
        if path is None:
            return
        entry = found[path]
        if counting[0] == 0:
            entry.calls += 1
        if record and path not in runs[-1]:
            runs[-1][path] = (tuple(call_args), dict(call_kwargs))
            if not entry.call_site:
                entry.call_site = user_location(sys._getframe(1))
        stack.append((path, attribute_fingerprint(module), _rng_state(), counter.get_total_flops()))

    def after(module, call_args, call_kwargs, output):
        path = paths.get(id(module))
        if path is None or not stack or stack[-1][0] != path:
            return
        _, attrs, rng, flops = stack.pop()
        entry = found[path]
        if counting[0] == 0:
            entry.flops += counter.get_total_flops() - flops
        elif counting[0] == 1:
            entry.eval_flops += counter.get_total_flops() - flops
        if entry.impurity is None:
            entry.impurity = _impurity(module, path, attrs, rng)

    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in copy.modules()]
    handles += [m.register_forward_hook(after, with_kwargs=True, always_call=True) for m in copy.modules()]
    saved_random = random.getstate()
    np = sys.modules.get("numpy")
    saved_numpy = np.random.get_state() if np is not None else None
    # train mode (what capture traces) on the example; recording, also eval mode (a module that train mode skipped,
    # LayerDrop, still gets inputs) and each batch
    plan = [(True, args, kwargs)] + ([(False, args, kwargs)] if record else [])
    plan += [(True, a, k) for a, k in batches or ()]
    try:
        with preserved_state(copy), torch.no_grad(), counter:
            for index, (training, call_args, call_kwargs) in enumerate(plan):
                counting[0] = index
                copy.train(training)
                runs.append({})
                stack.clear()
                copy(*call_args, **call_kwargs)
    except Exception:  # noqa: BLE001 - the probe only informs capture; a model it cannot run goes on without it
        return None
    finally:
        for handle in handles:
            handle.remove()
        random.setstate(saved_random)
        if saved_numpy is not None and np is not None:
            np.random.set_state(saved_numpy)
    if record:
        example_runs = runs[:2]
        for path, entry in found.items():
            entry.inputs = next((run[path] for run in example_runs if path in run), None)
            entry.batch_inputs = [run[path] for run in runs[2:] if path in run]
    _propagate(found)
    return Probe(found)


def _impurity(module: torch.nn.Module, path: str, attrs: dict, rng: tuple) -> Optional[Impurity]:
    """What the call of ``module`` that began with attributes ``attrs`` and RNG state ``rng`` did that a trace would
    bake in (None: nothing). torch's own modules keep caches of their own (nn.LSTM's _flat_weights), and libraries
    private bookkeeping (transformers' _output_capturing_hooks_installed): not the user's state."""
    now = _rng_state()
    if now[0] != rng[0] or now[1] != rng[1]:
        return Impurity("random", path, source="random" if now[0] != rng[0] else "numpy.random")
    if _is_torch_module(module):
        return None
    written = [name for name in _written(attrs, attribute_fingerprint(module))
               if not (name.startswith("_") and _is_library_module(module))]
    return Impurity("state", path, written=tuple(written)) if written else None


def _propagate(found: dict[str, ModuleProbe]) -> None:
    """An ancestor of an impure module is impure too (a capture of it would contain the child's draw or write)."""
    for path, entry in list(found.items()):
        if entry.impurity is None or not path:
            continue
        parts = path.split(".")
        for i in range(len(parts) - 1, -1, -1):
            parent = found.get(".".join(parts[:i]))
            if parent is not None and parent.impurity is None:
                parent.impurity = entry.impurity

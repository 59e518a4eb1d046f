"""CUDA graphs for the training step of a converted model: forward and backward replayed with one launch each.

Why: on a GPU a small converted model is bound by the host launching kernels, not by the GPU. In
``benchmarks/results/cuda_fp16.md`` (H100, torch 2.11) the 2-layer encoders, the CNN and the small
Hugging Face models keep the GPU busy 0.2–0.8 ms of 3–14 ms steps (about 700 aten calls per step), so
removing casts (O2) cannot pay: their O2 steps are 0.94–1.11× autocast and all slower than fp32.
A converted graph is static for a given batch shape, which is the case CUDA graphs exist for: the
forward's kernels and the backward's kernels are each recorded once and replayed with one launch.

::

    conv = converter.convert(model, example_inputs, precision="fp16", opt_level="O2")
    trainer = converter.MixedPrecisionTrainer(conv.module, optimizer, precision="fp16", master_weights=True)
    graphed = converter.cuda_graph(conv.module)      # after the trainer: O2 moves the weights once
    for x, y in batches:
        trainer.zero_grad()
        trainer.backward(loss_fn(graphed(x), y))     # forward and backward: one graph replay each
        trainer.step()                                # eager: unscale, check, skip/back off, step

What is graphed: the module's forward and its backward (``torch.autograd.grad`` of the outputs with
respect to the trainable parameters and the inputs that require grad), captured as two graphs in a
private memory pool per input signature, as :func:`torch.cuda.make_graphed_callables` does. The loss,
the loss scaling and the trainer's step stay eager, so a step on non-finite gradients is still
skipped and the loss scale backs off exactly as without graphs.

**Signatures.** A call is served by the graph of its signature: the train/eval flag, the nesting of
its arguments, and each tensor's shape, strides, dtype, device and ``requires_grad``. The first
``max_graphs`` signatures are captured when first seen (``warmup_iters`` eager forward/backward runs on
a side stream, then the capture); a call of any other signature (the last, smaller batch of an epoch
once the cache is full, a new padded length) runs the module eagerly. Nothing ever fails because a
shape changed.

**Eager calls.** These run the wrapped module as it is, with identical results: no CUDA device
(one :class:`CudaGraphWarning` when the wrapper is built; ``enabled`` is False), tensors not all on
one CUDA device (one warning), gradients disabled (``no_grad``, inference, evaluation loops), nothing
that requires grad, an active autocast, ``TorchDispatchMode``/``TorchFunctionMode``, saved-tensor
hooks (activation offloading), anomaly detection, ``torch.compile`` tracing or an enclosing stream
capture, an argument that is neither a tensor, a tuple/list/dict nor a plain constant, a signature
whose capture failed (one warning with the error: e.g. the forward synchronises with the host,
``.item()`` or ``nonzero``, which warm-up detects with ``torch.cuda.set_sync_debug_mode("error")``),
and a second forward of the same signature while the first one's backward is still pending (its
graph holds the first call's activations). ``stats.eager_reasons`` counts them by reason.

**Safety.** Each forward returns fresh copies of the graph's outputs (one copy kernel per output
tensor), so outputs kept across steps are never overwritten. A parameter's gradient may alias the
graph's gradient buffer (autograd takes a gradient it is handed without copying it); before every
replay such a gradient is copied out first, so gradient accumulation and ``zero_grad(set_to_none=False)``
give what eager gives. The graph reads the parameters and buffers at the addresses they had when it
was captured: when any of them moved (``.to()``, ``.data =``, a trainer built afterwards) or the
GraphModule was recompiled, the graphs are dropped and captured again (``stats.invalidations``).
Buffers that the forward updates (batch norm statistics) are restored after the warm-up runs, so a
capture leaves them as one eager call would. Python side effects of the forward (hooks that record
something, counters) run at capture only, never at replay.

**Memory.** Each captured signature keeps its activations, outputs and gradients in its own pool
(``stats.graph_bytes``: the CUDA memory the captures reserved); ``reset()`` frees them.

The wrapper is an ``nn.Module`` holding the model as ``.module`` (``state_dict`` keys start with
``module.``, as under ``DistributedDataParallel``); a trainer built on it unwraps it.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from converter.ir.errors import EXIT_INTERNAL, MpconvertError

__all__ = ["CudaGraphModule", "CudaGraphWarning", "GraphStats", "cuda_graph", "DEFAULT_MAX_GRAPHS",
           "DEFAULT_WARMUP_ITERS"]

#: signatures captured per wrapper: the training batch and one more (a fixed last batch, or eval under grad);
#: each keeps a step's activations alive, so the default stays small
DEFAULT_MAX_GRAPHS = 2
#: eager forward/backward runs on a side stream before a capture (cuBLAS/cuDNN handles, autotuning and other
#: lazy initialisation must not land in the graph); torch's make_graphed_callables uses 3
DEFAULT_WARMUP_ITERS = 3

#: signatures remembered as eager (nothing requires grad) at most, so that varying shapes cannot grow the cache
_MAX_REMEMBERED = 64
_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_TENSOR = object()  # marks a tensor leaf in an argument layout


class CudaGraphWarning(MpconvertError, UserWarning):
    """Calls of a :class:`CudaGraphModule` run eagerly (no CUDA device, a failed capture, a full cache ...);
    a warning, derived from :class:`MpconvertError` like every mpconvert exception class."""


@dataclasses.dataclass
class GraphStats:
    """Counters of a :class:`CudaGraphModule`.

    Attributes:
        captures: signatures captured (forward and backward graph each).
        replays: forward calls served by a graph.
        eager_calls: forward calls that ran the module eagerly.
        failed_captures: signatures whose capture failed (they run eagerly from then on).
        invalidations: times every graph was dropped because a parameter or buffer moved or the
            GraphModule was recompiled.
        eager_reasons: why calls ran eagerly, counted per reason.
        graph_bytes: CUDA memory reserved by the captures (pools of the graphs kept now).
    """

    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    failed_captures: int = 0
    invalidations: int = 0
    eager_reasons: Counter = dataclasses.field(default_factory=Counter)
    graph_bytes: int = 0


class _Token:
    """Lives as long as a replayed forward's autograd node; ``done`` once its backward ran."""

    __slots__ = ("done", "__weakref__")

    def __init__(self) -> None:
        self.done = False


@dataclasses.dataclass(eq=False)
class _Entry:
    """The graphs of one signature and the static tensors they read and write."""

    fwd: Any  # torch.cuda.CUDAGraph
    bwd: Any  # torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]
    grad_params: list[nn.Parameter]  # the trainable parameters at capture, passed to the autograd function
    static_outputs: list[torch.Tensor]  # the tensor leaves of the output
    out_leaves: list[Any]  # every output leaf: tensors are replaced per call
    out_tensor_at: list[int]  # positions of the tensor leaves in out_leaves
    out_spec: Any
    differentiable: list[bool]  # per static output
    static_grad_outputs: list[torch.Tensor | None]
    input_grads: list[torch.Tensor | None]  # per static input: its gradient buffer (None: none)
    param_grads: list[torch.Tensor | None]  # per grad_param
    nbytes: int = 0
    pending: Any = None  # weakref to the _Token of the last replayed forward

    def backward_pending(self) -> bool:
        token = self.pending() if self.pending is not None else None
        return token is not None and not token.done

    def unalias_grads(self) -> None:
        """A parameter gradient that is the graph's gradient buffer (autograd took it without a copy)
        gets memory of its own before a replay overwrites the buffer."""
        for param, buf in zip(self.grad_params, self.param_grads):
            grad = param.grad
            if grad is not None and buf is not None and grad.data_ptr() == buf.data_ptr():
                param.grad = grad.clone()


class _Replay(torch.autograd.Function):
    """One autograd node for a graphed forward; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, entry: _Entry, token: _Token, *tensors: torch.Tensor):  # type: ignore[override]
        entry.unalias_grads()
        for static, value in zip(entry.static_inputs, tensors):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        entry.fwd.replay()
        outputs = tuple(out.clone() for out in entry.static_outputs)
        ctx.entry = entry
        ctx.token = token
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, entry.differentiable) if not d))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        entry: _Entry = ctx.entry
        ctx.token.done = True
        entry.unalias_grads()
        for static, grad in zip(entry.static_grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        entry.bwd.replay()
        # input gradients are copied (their consumer is the caller's graph); parameter gradients are the
        # buffers themselves, made safe by unalias_grads before the next replay
        inputs = tuple(None if g is None else g.clone() for g in entry.input_grads)
        params = tuple(None if g is None else g.detach() for g in entry.param_grads)
        return (None, None) + inputs + params


def _flatten_args(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A hashable layout of ``obj`` with its tensors appended to ``leaves``; raises TypeError on other types."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _TENSOR
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, tuple(_flatten_args(v, leaves) for v in obj))
    if kind is dict:
        return (dict, tuple((k, _flatten_args(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, _CONSTANT_TYPES) or obj is Ellipsis:
        return (kind, obj)
    raise TypeError(type(obj).__name__)


def _unflatten_args(layout: Any, tensors: Any) -> Any:
    """The inverse of :func:`_flatten_args`; ``tensors`` is an iterator."""
    if layout is _TENSOR:
        return next(tensors)
    kind, value = layout
    if kind is tuple or kind is list:
        return kind(_unflatten_args(v, tensors) for v in value)
    if kind is dict:
        return {k: _unflatten_args(v, tensors) for k, v in value}
    return value


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _function_mode_active() -> bool:
    """A ``TorchFunctionMode`` other than a default-device context (``torch.set_default_device``) is active."""
    if not torch._C._len_torch_function_stack():
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return any(not isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


def _context_reason(cuda: bool) -> str | None:
    """Why a call must run eagerly whatever its arguments (None: a graph may serve it); about 3 µs.
    ``cuda``: also check for an enclosing stream capture (a CUDA call)."""
    if not torch.is_grad_enabled():
        return "gradients disabled"
    if torch.is_autocast_enabled("cuda"):
        return "autocast active"
    if _get_current_dispatch_mode() is not None or _function_mode_active():
        return "dispatch or function mode active"
    if _saved_tensor_hooks_active():
        return "saved-tensor hooks active"
    if torch.is_anomaly_enabled():
        return "anomaly detection"
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return "being compiled or traced"
    if cuda and torch.cuda.is_current_stream_capturing():
        return "inside another stream capture"
    return None


class CudaGraphModule(nn.Module):
    """``module`` whose training forward and backward replay CUDA graphs; see :mod:`converter.train.cuda_graph`.

    Build it with :func:`cuda_graph`. ``enabled`` is False without a CUDA device (every call is eager);
    ``stats`` counts captures, replays and eager calls; ``reset()`` drops the graphs.
    """

    _device_type = "cuda"  # the device whose tensors a graph may hold (the CPU tests emulate graphs on "cpu")

    def __init__(self, module: nn.Module, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 warmup_iters: int = DEFAULT_WARMUP_ITERS) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, CudaGraphModule):
            raise ValueError("module is already a CudaGraphModule")
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or _is_fsdp(module):
            raise ValueError(
                f"cuda_graph does not graph a {type(module).__name__}: its gradient reduction runs in autograd hooks "
                "between the backward's kernels, which a graph replay would skip. Train data-parallel models eagerly."
            )
        for name, value in (("max_graphs", max_graphs), ("warmup_iters", warmup_iters)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        super().__init__()
        self.module = module
        self.max_graphs = max_graphs
        self.warmup_iters = warmup_iters
        self.stats = GraphStats()
        self._entries: dict[Any, _Entry | str] = {}  # signature -> its graphs, or why it runs eagerly
        self._state: tuple | None = None  # parameter/buffer addresses and code the graphs were captured with
        self._graph_params: list[nn.Parameter] = []  # what the graphs read, listed at the first capture
        self._graph_buffers: list[torch.Tensor] = []
        self._capture_error: str | None = None  # a capture failed: no more are tried until reset()
        self._warned: set[str] = set()
        self.enabled = torch.cuda.is_available()
        if not self.enabled:
            self._warn("no_cuda", "cuda_graph: no CUDA device is available; the module runs eagerly "
                       "(CUDA graphs need one). Results are those of the module itself.")

    # ------------------------------------------------------------------ public
    def reset(self) -> None:
        """Drop every captured graph and its memory; the next calls capture again."""
        self._entries.clear()
        self._state = None
        self._capture_error = None
        self.stats.graph_bytes = 0

    @property
    def graphs(self) -> int:
        """Signatures with a captured graph now."""
        return sum(1 for e in self._entries.values() if isinstance(e, _Entry))

    @property
    def capture_error(self) -> str | None:
        """The error of the capture that failed (calls then run eagerly until ``reset()``), else None."""
        return self._capture_error

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self._eager("no CUDA device", args, kwargs)
        reason = _context_reason(self._device_type == "cuda")
        if reason is not None:
            return self._eager(reason, args, kwargs)
        leaves: list[torch.Tensor] = []
        try:
            layout = _flatten_args((args, kwargs), leaves)
        except TypeError as exc:
            self._warn("argument", f"cuda_graph: an argument of type {exc} is not a tensor, a tuple/list/dict or a "
                       "plain constant; such calls run eagerly")
            return self._eager("unsupported argument", args, kwargs)
        if self._state is not None and self._current_state() != self._state:
            self.stats.invalidations += 1
            self.reset()
        key = (self.module.training, layout, tuple(_tensor_key(t) for t in leaves))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, layout, leaves)
        if isinstance(entry, str):
            return self._eager(entry, args, kwargs)
        if entry.backward_pending():
            self._warn("pending", "cuda_graph: a forward of the same input signature ran again before the previous "
                       "one's backward; it runs eagerly (the graph holds the first call's activations)")
            return self._eager("backward pending", args, kwargs)
        token = _Token()
        entry.pending = weakref.ref(token)
        outputs = _Replay.apply(entry, token, *leaves, *entry.grad_params)
        self.stats.replays += 1
        out_leaves = list(entry.out_leaves)
        for at, value in zip(entry.out_tensor_at, outputs):
            out_leaves[at] = value
        return pytree.tree_unflatten(out_leaves, entry.out_spec)

    # ------------------------------------------------------------------ helpers
    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, CudaGraphWarning, stacklevel=4)

    def _eager(self, reason: str, args: tuple, kwargs: dict) -> Any:
        self.stats.eager_calls += 1
        self.stats.eager_reasons[reason] += 1
        return self.module(*args, **kwargs)

    def _current_state(self) -> tuple:
        """What the graphs depend on besides their inputs: every parameter's and buffer's address and
        ``requires_grad`` (a move, ``.data =``, an O2 trainer built afterwards), and the module's code (a
        recompiled GraphModule has a new ``forward``; ``converter.apply`` sets an instance ``forward``)."""
        module = self.module
        return (type(module).forward, module.__dict__.get("forward"),
                tuple((p.data_ptr(), p.requires_grad) for p in self._graph_params),
                tuple(b.data_ptr() for b in self._graph_buffers))

    def _new_entry(self, key: Any, layout: Any, leaves: list[torch.Tensor]) -> _Entry | str:
        """The graphs for a signature seen for the first time, or why it runs eagerly."""
        module = self.module
        if self._state is None:  # first capture, or after a reset: (re)list what the graphs will read
            self._graph_params = list(module.parameters())
            self._graph_buffers = list(module.buffers())
        tensors = [*leaves, *self._graph_params, *self._graph_buffers]
        device = tensors[0].device if tensors else None
        if device is None or device.type != self._device_type or any(
                t.device != device or t.layout != torch.strided for t in tensors):
            self._warn("device", "cuda_graph: the module's parameters, buffers and tensor arguments are not all "
                       "strided tensors on one CUDA device; such calls run eagerly")
            return "not on one CUDA device"
        if self._capture_error is not None:
            return "capture failed"
        self._state = self._current_state()  # what is remembered from here holds until it changes
        if not any(p.requires_grad for p in self._graph_params) and not any(t.requires_grad for t in leaves):
            return self._remember(key, "nothing requires grad")
        if self.graphs >= self.max_graphs:
            self._warn("full", f"cuda_graph: {self.max_graphs} input signature(s) are captured (max_graphs); "
                       "calls of other shapes, dtypes or train/eval mode run eagerly")
            return "cache full"
        return self._remember(key, self._capture(layout, leaves, device))

    def _remember(self, key: Any, entry: _Entry | str) -> _Entry | str:
        if isinstance(entry, _Entry) or len(self._entries) < _MAX_REMEMBERED:
            self._entries[key] = entry
        return entry

    def _capture(self, layout: Any, leaves: list[torch.Tensor], device: torch.device) -> _Entry | str:
        """Warm up on a side stream, then capture the forward and the backward graph of one signature."""
        module = self.module
        static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        grad_params = [p for p in self._graph_params if p.requires_grad]
        surface = [t for t in static_inputs if t.requires_grad] + grad_params
        buffers = self._graph_buffers

        def run() -> Any:
            args, kwargs = _unflatten_args(layout, iter(static_inputs))
            return module(*args, **kwargs)

        def differentiate(output: Any, grad_outputs: list[torch.Tensor] | None) -> tuple:
            diff = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not diff:
                raise _NotGraphable("no output requires grad")
            if grad_outputs is None:
                grad_outputs = [torch.zeros_like(t) for t in diff]
            return torch.autograd.grad(diff, surface, grad_outputs=grad_outputs, allow_unused=True)

        # the warm-up runs update buffers (batch norm statistics) and draw random numbers (dropout): both are
        # put back, so that a capture leaves the module as the one eager call it stands for
        saved = [b.detach().clone() for b in buffers]
        try:
            self._warm_up(lambda: differentiate(run(), None), device)
            _restore(buffers, saved)
            torch.cuda.empty_cache()  # torch.cuda.graph empties it too: measure the captures' memory from here
            reserved = torch.cuda.memory_reserved(device)
            pool = torch.cuda.graph_pool_handle()
            fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fwd, pool=pool, capture_error_mode="thread_local"):
                output = run()
            out_leaves, out_spec = pytree.tree_flatten(output)
            out_tensor_at = [i for i, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
            static_outputs = [out_leaves[i] for i in out_tensor_at]
            differentiable = [t.requires_grad for t in static_outputs]
            static_grad_outputs = [torch.empty_like(t) if d else None for t, d in zip(static_outputs, differentiable)]
            bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bwd, pool=pool, capture_error_mode="thread_local"):
                grads = differentiate(output, [g for g in static_grad_outputs if g is not None])
            torch.cuda.synchronize(device)
        except _NotGraphable as exc:
            _restore(buffers, saved)
            return exc.reason
        except Exception as exc:  # noqa: BLE001 - any failure means: run eagerly, and say why once
            _restore(buffers, saved)
            return self._capture_failed(exc)
        grad_iter = iter(grads)
        input_grads = [next(grad_iter) if t.requires_grad else None for t in static_inputs]
        param_grads = [next(grad_iter) for _ in grad_params]
        for at in out_tensor_at:
            out_leaves[at] = None  # the static tensors are kept once, in static_outputs
        entry = _Entry(fwd=fwd, bwd=bwd, static_inputs=static_inputs, grad_params=grad_params,
                       static_outputs=[t.detach() for t in static_outputs], out_leaves=out_leaves,
                       out_tensor_at=out_tensor_at, out_spec=out_spec, differentiable=differentiable,
                       static_grad_outputs=static_grad_outputs, input_grads=input_grads, param_grads=param_grads,
                       nbytes=max(0, torch.cuda.memory_reserved(device) - reserved))
        self.stats.captures += 1
        self.stats.graph_bytes += entry.nbytes
        return entry

    def _warm_up(self, iteration: Callable[[], Any], device: torch.device) -> None:
        """Run ``iteration`` (a forward and its backward) ``warmup_iters`` times on a side stream, with host syncs
        made errors (a host sync cannot be captured: found here, with a message); the RNG state is put back."""
        rng = torch.cuda.get_rng_state(device)
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup_iters):
                    iteration()
        finally:
            torch.cuda.set_sync_debug_mode(sync_mode)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        torch.cuda.set_rng_state(rng, device)

    def _capture_failed(self, exc: Exception) -> str:
        """Count and warn about (once) a failed capture; the reason the call runs eagerly."""
        self.stats.failed_captures += 1
        text = str(exc).strip()
        why = text.splitlines()[0] if text else type(exc).__name__
        hint = (" (the forward or backward synchronises with the host, e.g. .item(), nonzero or a CPU->GPU copy, "
                "which a CUDA graph cannot hold)" if "synchroniz" in why else "")
        self._capture_error = f"{type(exc).__name__}: {why}"
        self._warn("capture", f"cuda_graph: capturing {type(self.module).__name__} failed{hint}: {self._capture_error}; "
                   "its calls run eagerly")
        return "capture failed"


class _NotGraphable(MpconvertError):
    """The call has nothing for a training graph to do (it runs eagerly, without a warning). Caught inside
    this module; never reaches a user (exit code 3 if it ever did: our bug)."""

    exit_code = EXIT_INTERNAL

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        #: why the call runs eagerly (what the capture returns)
        self.reason = reason


def _restore(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for buf, value in zip(buffers, saved):
            buf.copy_(value)


def _is_fsdp(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def cuda_graph(module: nn.Module, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
               warmup_iters: int = DEFAULT_WARMUP_ITERS) -> CudaGraphModule:
    """Wrap ``module`` so that its training forward and backward replay CUDA graphs (:class:`CudaGraphModule`).

    Call it after building the :class:`~converter.MixedPrecisionTrainer` (O2 gives the weights new
    storage once; a move after capture is detected and recaptured, at a capture's cost) and call the
    returned module instead of ``module``. Without a CUDA device it returns a wrapper whose calls run
    ``module`` eagerly, with one :class:`CudaGraphWarning`.

    Args:
        module: the model, usually ``converter.convert(...).module``; not DDP/FSDP-wrapped.
        max_graphs: input signatures (shapes, dtypes, train/eval) captured at most; calls of others
            run eagerly. Each keeps its activations alive (:attr:`GraphStats.graph_bytes`).
        warmup_iters: eager forward/backward runs on a side stream before each capture.
    """
    return CudaGraphModule(module, max_graphs=max_graphs, warmup_iters=warmup_iters)

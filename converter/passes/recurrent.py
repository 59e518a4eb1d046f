"""Keep torch.export from fixing the sequence length of ``nn.LSTM``/``nn.GRU``/``nn.RNN``.

torch.export records ``aten.lstm.input`` as one op, but it computes the op's output sizes with
torch's Python decomposition of the op (``torch._decomp.decompositions.lstm_impl``), which loops
over the time steps (``for x in input.unbind(0)``). ``unbind`` needs the number of steps as a
Python int, so the sequence length is guarded to the example's (``Eq(s1, 12)``) and the captured
graph refuses every other length (``Guard failed: input_ids.size()[1] == 12``). The batch stays
dynamic: the loop never reads it.

During capture, :class:`RecurrentOps` (a ``TorchFunctionMode``, active only around
``torch.export.export``) routes the calls that the RNN modules make (``torch._VF.lstm``, ``gru``,
``rnn_tanh``, ``rnn_relu``, padded-batch overloads only) to the custom ops ``mpconvert::lstm`` ...
Their kernels call the aten op itself; their fake kernels give the output sizes directly (the
input's leading dims, the hidden size times the directions; the final states as the initial
ones), without a loop. :func:`restore_aten_ops` then puts the aten ops back into the exported
graph, argument for argument, so the graph is what torch.export records anyway, with the sequence
dim dynamic, and it needs nothing from this package to run. Packed sequences (``lstm.data``,
whose batch sizes are data) are left to torch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from converter.ir.graphmodule import retarget_calls

__all__ = ["RecurrentOps", "restore_aten_ops"]

_ARGS = "bool has_biases, int num_layers, float dropout, bool train, bool bidirectional, bool batch_first"


def _lstm_kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return torch.ops.aten.lstm.input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)


def _check_state(input, state, params, num_layers, bidirectional, batch_first, width) -> None:
    """The size checks aten makes on an initial state (they relate its dims to the input's and the
    weights', so that export keeps a given state's dims consistent with them)."""
    batch = input.shape[0] if batch_first else input.shape[1]
    torch._check(input.shape[-1] == params[0].shape[1], lambda: "input size differs from the RNN's")
    torch._check(state.shape[0] == num_layers * (2 if bidirectional else 1), lambda: "state has the wrong number of layers")
    torch._check(state.shape[1] == batch, lambda: "state batch differs from the input's")
    torch._check(state.shape[2] == width, lambda: "state size differs from the RNN's")


def _lstm_fake(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    # h0 is (layers * directions, batch, proj_size or hidden); c0 is (..., hidden); w_hh is (4 * hidden, proj or hidden)
    _check_state(input, hx[0], params, num_layers, bidirectional, batch_first, params[1].shape[1])
    _check_state(input, hx[1], params, num_layers, bidirectional, batch_first, params[1].shape[0] // 4)
    width = (2 if bidirectional else 1) * hx[0].shape[-1]
    return input.new_empty((*input.shape[:-1], width)), torch.empty_like(hx[0]), torch.empty_like(hx[1])


def _single_state_op(name: str):
    aten = getattr(torch.ops.aten, name).input

    def kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        return aten(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)

    def fake(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        _check_state(input, hx, params, num_layers, bidirectional, batch_first, params[1].shape[1])
        width = (2 if bidirectional else 1) * hx.shape[-1]
        return input.new_empty((*input.shape[:-1], width)), torch.empty_like(hx)

    op = torch.library.custom_op(
        f"mpconvert::{name}", kernel, mutates_args=(),
        schema=f"(Tensor input, Tensor hx, Tensor[] params, {_ARGS}) -> (Tensor, Tensor)")
    op.register_fake(fake)
    return op


def _define_ops() -> dict[str, Any]:
    lstm = torch.library.custom_op(
        "mpconvert::lstm", _lstm_kernel, mutates_args=(),
        schema=f"(Tensor input, Tensor[] hx, Tensor[] params, {_ARGS}) -> (Tensor, Tensor, Tensor)")
    lstm.register_fake(_lstm_fake)
    ops = {"lstm": lstm, **{name: _single_state_op(name) for name in ("gru", "rnn_tanh", "rnn_relu")}}
    return {name: getattr(torch.ops.mpconvert, name).default for name in ops}


#: RNN op name -> the custom op that stands in for its ``.input`` overload during capture
_STAND_INS = _define_ops()
#: the builtins the RNN modules call (torch._VF.lstm is torch._C._VariableFunctions.lstm)
_CALLS = {getattr(torch._C._VariableFunctions, name): op for name, op in _STAND_INS.items()}
#: custom op -> the aten overload it stands in for
_ATEN = {op: getattr(torch.ops.aten, name).input for name, op in _STAND_INS.items()}


class RecurrentOps(TorchFunctionMode):
    """Route the RNN modules' ``torch._VF`` calls to the stand-in ops (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _CALLS.get(func) if not kwargs and len(args) == 9 else None
        # .input overloads: (input, hx, params, has_biases, ...); .data (packed): (data, batch_sizes, hx, params, ...)
        if op is not None and isinstance(args[3], bool):
            return op(*args)
        return func(*args, **kwargs)


def restore_aten_ops(gm: torch.fx.GraphModule) -> int:
    """Replace the stand-in ops in ``gm`` by the aten ops they stand for; returns how many."""
    return retarget_calls(gm, _ATEN)

"""The ONNX export call: ``torch.onnx.export`` with the dynamo exporter, falling back to TorchScript.

:func:`export_copy` makes the module to export (a copy in eval mode with O2's half parameters),
:func:`export_model` exports it to an in-memory ``ModelProto`` (the fallback leaves a notice and a
``UserWarning``; both failing is an :class:`OnnxExportError`), :func:`save_model` writes it
(external data past the 2 GiB protobuf limit) and :func:`fp32_export` exports the fp32 original for
the size comparison.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Optional, TypeVar

import torch
import torch.fx

from converter.export.onnx_graph import onnx_casts, strip_debug_metadata
from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.graphmodule import TwoModeGraphModule

__all__ = ["OnnxExportError", "quiet_deepcopy", "export_copy", "set_eval", "export_model", "save_model", "fp32_export"]


class OnnxExportError(MpconvertError, RuntimeError):
    """Neither exporter could export the model; the message gives both reasons."""

    exit_code = EXIT_CHECK_FAILED  # the requested --onnx check could not be done


_M = TypeVar("_M", bound=torch.nn.Module)

def quiet_deepcopy(module: _M) -> _M:
    """``copy.deepcopy(module)`` without torch.export's deprecation warnings."""
    with warnings.catch_warnings():  # torch.export's pytree specs warn on deepcopy (LeafSpec deprecation)
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module)


def export_copy(conv_module: torch.fx.GraphModule, param_dtypes: dict) -> torch.fx.GraphModule:
    """A copy of the converted module in eval mode with parameters stored per ``mp_param_dtypes``."""
    gm = quiet_deepcopy(conv_module)
    if isinstance(gm, TwoModeGraphModule):  # torch.export interprets `graph`, the train graph: give it eval's
        gm = gm.for_mode(False)
    with torch.no_grad():
        for name, param in gm.named_parameters():
            dtype = param_dtypes.get(name)
            if dtype is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)
    _masks_in_query_dtype(gm)  # fully masked rows as the original's (fp32_attention)
    set_eval(gm)
    return gm


def fp32_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor,
                   dropout_p: float = 0.0, is_causal: bool = False, scale=None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of half q, k, v with an fp32 mask, as the exported copy runs it: in fp32, rounded once to half.

    The converted graph hands attention an fp32 mask (``finfo(float32).min`` where masked, see
    :func:`converter.passes.rewrite._attention_mask`); ONNX adds a mask to scores of one dtype. Cast to half, that
    value becomes -inf (or, saturated, is no longer absorbed by the scores): a fully masked row would not be the
    original's uniform average. In fp32 it is what the original computes (ONNX Runtime has no fused half kernel that
    takes an fp32 mask)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.to(torch.float32), key.to(torch.float32), value.to(torch.float32), attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa)
    return out.to(query.dtype)


def _attention_targets() -> tuple:
    from converter.kernels.upcast import dispatch_attention, upcast_attention

    return (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
            dispatch_attention, upcast_attention)


def _masks_in_query_dtype(gm: torch.fx.GraphModule) -> None:
    """Each attention call given an fp32 mask with half q/k/v runs :func:`fp32_attention` (the exported copy only)."""
    from converter.passes.rewrite import runtime_dtype

    targets = _attention_targets()
    cache: dict = {}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets or not node.args:
            continue
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if not isinstance(mask, torch.fx.Node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        have, want = runtime_dtype(mask, cache), runtime_dtype(node.args[0], cache)
        if have == torch.float32 and want in (torch.float16, torch.bfloat16):
            node.target = fp32_attention
            changed = True
    if changed:
        gm.recompile()


def set_eval(module: torch.nn.Module) -> None:
    """Put ``module`` in eval mode where it allows it."""
    try:
        module.eval()
    except Exception:  # exported GraphModules of some torch versions refuse eval(); they were captured in eval
        pass


def _input_names(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    names = []
    if isinstance(module, torch.fx.GraphModule):
        names = [n.target for n in module.graph.nodes if n.op == "placeholder"]
    names = [str(n) for n in names[: len(args)]] if names else [f"input_{i}" for i in range(len(args))]
    return names + [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


def export_model(module: torch.nn.Module, args: tuple, kwargs: dict, *, opset: int, exporter: str, notes: list[str],
                 translations: Optional[dict] = None):
    """Export to an in-memory ModelProto; returns (model, exporter used).

    ``translations``: the dynamo exporter's ``custom_translation_table`` (custom op -> its ONNX function);
    a module that needs one is exported with ``exporter="dynamo"`` (TorchScript cannot use it)."""
    import onnx

    errors: dict[str, str] = {}
    order = {"auto": ("dynamo", "torchscript"), "dynamo": ("dynamo",), "torchscript": ("torchscript",)}[exporter]
    for which in order:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if which == "dynamo":
                    program = torch.onnx.export(module, args, kwargs=kwargs or None, dynamo=True, opset_version=opset,
                                                verbose=False, optimize=True, custom_translation_table=translations)
                    assert program is not None  # (dynamo=True returns the program)
                    model = program.model_proto
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        f = os.path.join(tmp, "ts.onnx")
                        torch.onnx.export(module, args, f, kwargs=kwargs or None, dynamo=False, opset_version=opset,
                                          input_names=_input_names(module, args, kwargs), do_constant_folding=True)
                        model = onnx.load(f)
            if errors:
                msg = f"the dynamo exporter failed ({errors['dynamo']}); fell back to the TorchScript exporter"
                notes.append(msg)
                warnings.warn(msg, UserWarning, stacklevel=3)
            return model, which
        except Exception as exc:  # the reason is kept and reported; the next exporter is tried
            errors[which] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    raise OnnxExportError("ONNX export failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))


def save_model(model, path: Path) -> int:
    """Write ``model`` atomically; weights go to an external ``.data`` file past the 2 GiB protobuf limit.

    Both files are written into a hidden temporary folder beside ``path`` and renamed into place,
    the ``.data`` file first and the model last, so a failed write (a file-size limit, a full disk,
    a kill) leaves whatever was at ``path`` before and no temporary behind."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    big = model.ByteSize() > 1_800_000_000 if _byte_size_ok(model) else True
    data = path.with_name(path.name + ".data")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        if big:
            onnx.save_model(model, str(tmp / path.name), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name)
            if (tmp / data.name).exists():
                os.replace(tmp / data.name, data)
        else:
            onnx.save_model(model, str(tmp / path.name))
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = path.stat().st_size
    if big and data.exists():
        size += data.stat().st_size
    return size


def _byte_size_ok(model) -> bool:
    try:
        model.ByteSize()
        return True
    except Exception:
        return False


def fp32_export(conv, args, kwargs, *, opset: int, exporter: str, notes: list[str],
               keep_debug_metadata: bool) -> tuple[Optional[int], Optional[int]]:
    """Size in bytes (and Cast count) of the export of the fp32 original."""
    original = quiet_deepcopy(conv.original)
    set_eval(original)
    try:
        model, _ = export_model(original, args, kwargs, opset=opset, exporter=exporter, notes=[])
    except OnnxExportError as exc:
        notes.append(f"the fp32 original could not be exported for the size comparison: {exc}")
        return None, None
    if not keep_debug_metadata:
        strip_debug_metadata(model)
    with tempfile.TemporaryDirectory() as tmp:
        size = save_model(model, Path(tmp) / "fp32.onnx")
    return size, len(onnx_casts(model))

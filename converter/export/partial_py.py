"""model.py for a model converted region by region (:mod:`converter.partition`).

The output folder holds:

* ``user_model.py``: the model file, copied: its code is the glue (the parts no tracer captured);
* ``_mp_region_N.py``: each region's converted graph as plain PyTorch code, the same file
  :mod:`converter.export.model_py` writes for a whole model (its ``_build`` attaches tensors);
* ``model.safetensors``: the model's ``state_dict`` (its own names; a tied tensor once) and, under
  ``_mp_region_N.``, the tensor constants a region's graph reads;
* ``model.py`` (``templates/partial_model.py.tmpl``): ``load()`` builds the model with the user's code,
  loads the weights strictly, and puts each region's graph on its submodule and autocast on each glue
  module. Torch only: the weights are read by the region files' own safetensors reader.

Before publishing, model.py is loaded from the files and checked bit for bit against ``conv.module``.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from converter.export.errors import EmitError, VerificationError
from converter.export.model_py import generate_model_source
from converter.export.notes import EmitNote, check, warning
from converter.export.source_text import doc_text, render_template
from converter.export.weights import write_weights
from converter.numerics.common import output_tensors, preserved_state

__all__ = ["PartialSource", "generate_partial_source", "write_partial", "CONSTANT_PREFIX", "verify_partial"]

#: the weights file's prefix for a region's own tensor constants (``_mp_region_0._tensor_constant0``)
CONSTANT_PREFIX = "_mp_region_"


class PartialSource:
    """What :func:`generate_partial_source` made: file name -> text, the tensors to write, and warnings."""

    def __init__(self, files: dict[str, str], tensors: dict[str, torch.Tensor], warnings: list[str], model_file: Path):
        self.files = files
        #: the model file whose code is the glue (copied as user_model.py)
        self.model_file = model_file
        self.tensors = tensors
        self.warnings = warnings


def _input_spec(forward: Any) -> dict:
    """What a region's graph serves, from its :class:`~converter.inplace.ConvertedForward`."""
    positional, keywords = forward._captured_keys
    inputs: dict[str, dict] = {}
    for name, value in forward._example.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            label = name + pytree.keystr(path)
            if isinstance(leaf, torch.Tensor):
                dims = range(leaf.dim()) if forward._all_dynamic else forward._dynamic.get(label, ())
                ranges = forward._ranges.get(label, {})
                inputs[label] = {"dtype": str(leaf.dtype), "shape": list(leaf.shape),
                                 "dynamic": {str(d): list(ranges.get(int(d), (None, None))) for d in dims}}
            else:
                inputs[label] = {"value": repr(leaf)}
    return {"positional": list(positional), "keywords": list(keywords), "inputs_named": list(forward._example),
            "inputs": inputs}


def _entry_name(model_file: Path, root_type: str) -> str:
    """What model.py calls in the copied model file: ``build_model`` (the model-file contract), ``model``, or the class."""
    text = model_file.read_text(encoding="utf-8", errors="replace")
    if "def build_model" in text:
        return "build_model"
    if "\nmodel =" in text or text.startswith("model ="):
        return "model"
    return root_type


def _unique_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The ``state_dict`` with each tensor once, and alias -> stored name for the tied ones."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in module.state_dict(keep_vars=False).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = tensor
    return stored, aliases


def generate_partial_source(conv, *, model_file: Optional[str]) -> PartialSource:
    """model.py, the region files and the tensors to write for a partial conversion (nothing is written)."""
    from converter._version import __version__

    partition = conv.partition
    if not partition.regions:
        raise EmitError("no part of the model could be converted (every submodule broke capture; see report.json "
                        "graph_breaks): there is no converted model to write; run the model under torch.autocast")
    source = Path(model_file) if model_file else Path(inspect.getsourcefile(type(conv.original)) or "")
    if not source.is_file():
        raise EmitError(f"cannot write model.py: the source of {type(conv.original).__name__} is not a file "
                        "(model.py runs the model's own code between its converted regions)")
    files: dict[str, str] = {}
    tensors, aliases = _unique_state(conv.module)
    notes: list[str] = []
    specs = []
    for index, region in enumerate(partition.regions):
        made = generate_model_source(region.conversion)
        file_name = f"{CONSTANT_PREFIX}{index}.py"
        files[file_name] = made.code
        notes += made.warnings
        sub = conv.module.get_submodule(region.path)
        own = {n for n, _ in sub.named_parameters(remove_duplicate=False)} | {n for n, _ in sub.named_buffers(remove_duplicate=False)}
        for name, tensor in made.tensors.items():
            if name not in own:
                tensors[f"{CONSTANT_PREFIX}{index}.{name}"] = tensor
        specs.append({"index": index, "path": region.path, "file": file_name, "class": made.class_name,
                      **_input_spec(sub.forward)})
    breaks = "".join(f"- {b.module or '(root)'} ({b.module_type}) at {b.location or '?'}: {b.reason}; runs {b.runs}\n"
                     for b in partition.breaks)
    files["model.py"] = render_template(
        "partial_model.py.tmpl",
        title=doc_text(f"{type(conv.original).__name__} converted to mixed precision ({conv.precision}) by mpconvert "
                       f"{__version__}."),
        summary=doc_text(f"{conv.report.line}."),
        user_model=repr("user_model.py"),
        region_files=doc_text(", ".join(s["file"] for s in specs)),
        breaks=doc_text(breaks),
        precision=repr(str(conv.precision)),
        glue=repr(list(partition.glue)),
        regions=repr(specs),
        training=repr(bool(conv.module.training)),
        aliases=repr(aliases),
        constant_prefix=repr(CONSTANT_PREFIX),
        entry=repr(_entry_name(source, type(conv.original).__name__)),
    )
    for name, text in files.items():
        try:
            compile(text, name, "exec")
        except SyntaxError as exc:  # a bug in this generator; never publish broken code
            raise EmitError(f"internal error: generated {name} does not compile ({exc.msg} at line {exc.lineno}); "
                            "please report it") from exc
    return PartialSource(files, tensors, [warning(n) for n in notes], source)


def write_partial(tmp: Path, made: PartialSource, *, max_shard_size: int) -> None:
    """Write the files of :func:`generate_partial_source` into ``tmp`` (the output's temporary folder)."""
    import shutil

    for name, text in made.files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    shutil.copyfile(made.model_file, tmp / "user_model.py")
    write_weights(made.tensors, tmp, max_shard_size=max_shard_size)


def verify_partial(conv, directory: Path) -> EmitNote:
    """Load ``directory/model.py`` from its files and compare it with ``conv.module`` bit for bit (eval mode)."""
    from converter.export.verify import import_file

    args, kwargs = conv.example_inputs
    emitted = import_file(directory / "model.py").load()
    with preserved_state(conv.module), torch.no_grad():
        conv.module.eval()
        emitted.eval()
        torch.manual_seed(0)
        ref = output_tensors(conv.module(*args, **kwargs))
        torch.manual_seed(0)
        got = output_tensors(emitted(*args, **kwargs))
    if len(got) != len(ref):
        raise VerificationError(f"emitted model.py returns {len(got)} tensors, the converted model {len(ref)}; please report this bug")
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise VerificationError(f"emitted model.py differs from the converted model on output {i}; please report this bug")
    return check(f"model.py (user code + {len(conv.partition.regions)} converted regions) reproduces the converted "
                 f"model bit-exactly on CPU ({len(ref)} output tensors)")

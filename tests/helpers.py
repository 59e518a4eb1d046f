"""Shared test helpers: load sample model files, record runtime dtypes, compare against fp32."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import venv
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from converter.numerics.common import sqnr_db

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"


def load_sample(name: str) -> ModuleType:
    path = SAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"sample_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def split_inputs(example):
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], tuple) and isinstance(example[1], dict):
        return example
    return tuple(example), {}


def first_tensor(out):
    """The main output tensor of a model (HF ModelOutput -> logits)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        return out.get("logits", next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    raise TypeError(type(out))


#: the SQNR the tests use is mpconvert's own (dB, +inf when exact)
sqnr = sqnr_db


class DtypeRecorder(TorchDispatchMode):
    """Records, for every aten op, the dtypes of its floating tensor inputs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = []

        def visit(a):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                dtypes.append(a.dtype)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)

        for a in list(args) + list(kwargs.values()):
            visit(a)
        self.calls.append((func.overloadpacket.__name__, tuple(dtypes)))
        return func(*args, **kwargs)

    def dtypes_of(self, *names: str) -> list[tuple]:
        return [d for n, d in self.calls if n in names]


class CastCounter(TorchDispatchMode):
    """Counts dtype-changing ``aten._to_copy`` calls; separates parameter (weight) casts."""

    def __init__(self, params=()):
        super().__init__()
        self.param_ids = {id(p) for p in params}
        self.casts = 0
        self.bytes = 0
        self.weight_casts = 0
        self.weight_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten._to_copy and isinstance(out, torch.Tensor):
            src = args[0]
            if src.dtype != out.dtype:
                moved = src.numel() * src.element_size() + out.numel() * out.element_size()
                if id(src) in self.param_ids:
                    self.weight_casts += 1
                    self.weight_bytes += moved
                else:
                    self.casts += 1
                    self.bytes += moved
        return out


#: what torch needs importable in the torch-only venv of the emitted-file tests
TORCH_DISTRIBUTIONS = ("torch", "functorch", "torchgen", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2",
                       "markupsafe", "filelock", "fsspec")


def torch_only_python(base: Path, *, extra: tuple[str, ...] = ()) -> str:
    """A venv without system site-packages whose only addition is a .pth file naming a folder that links torch and its
    own dependencies (and the ``extra`` distributions): transformers and converter are not importable."""
    env_dir = base / "torch_only_venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False, symlinks=True)
    python = str(env_dir / "bin" / "python")
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    links = base / "torch_site"
    links.mkdir()
    for name in TORCH_DISTRIBUTIONS + extra:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        target = origin.parent if origin.name == "__init__.py" else origin
        (links / target.name).symlink_to(target)
    Path(site, "torch_only.pth").write_text(f"{links}\n")
    return python


def _summary_of(conversion) -> dict:
    """The report summary of a :class:`converter.Conversion`, a :class:`Report`, a report.json dict or its path."""
    if isinstance(conversion, (str, Path)):
        import json
        conversion = json.loads(Path(conversion).read_text())
    report = getattr(conversion, "report", conversion)
    summary = report["summary"] if isinstance(report, dict) else report.summary
    return summary


def half_share(conversion) -> float:
    """The share of the conversion's FLOPs that its report says run in fp16/bf16."""
    return float(_summary_of(conversion)["half_flop_fraction"])


def assert_half_ran(conversion, *, min_share: float = 0.5, min_nodes: int = 1, label: str = "") -> float:
    """Proves that half precision ran: at least ``min_nodes`` compute nodes in fp16/bf16 and at least
    ``min_share`` of the FLOPs. A conversion that leaves every op in fp32 (``--plant-fp32``) fails here,
    whatever its SQNR. Returns the half-FLOP share."""
    summary = _summary_of(conversion)
    by = summary["by_precision"]
    half_nodes = by.get("fp16", 0) + by.get("bf16", 0)
    share = float(summary["half_flop_fraction"])
    where = f"{label}: " if label else ""
    assert half_nodes >= min_nodes, f"{where}{half_nodes} compute nodes in half (by precision {by}), want >= {min_nodes}"
    assert share >= min_share, (f"{where}{100 * share:.1f}% of {summary['flops']} FLOPs in half, want >= {100 * min_share:.0f}% "
                                f"(by precision {by})")
    return share


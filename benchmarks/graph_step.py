"""Graph-side overhead: the converted module with and without the simplify pass.

Same model, step and clock as ``benchmarks/trainer_step.py`` (``nn.TransformerEncoder`` d128, 4
heads, ff 256, 2 layers, B2×T16, dropout 0, bf16, SGD lr 1e-4 momentum 0.9, one torch thread,
thread CPU clock, interleaved medians). Variants:

* ``autocast`` — the original model under ``torch.autocast("cpu", dtype=bfloat16)``, plain SGD;
* ``O1`` / ``O2`` — ``converter.convert(..., opt_level=...)`` driven by ``MixedPrecisionTrainer``
  (``master_weights`` for O2), with the simplify pass (what ``convert`` does);
* ``O1_raw`` / ``O2_raw`` — the same conversion with the simplify pass switched off
  (``converter.api.pipeline(simplify_graph=False)``): the before of the before/after.

Run: ``python benchmarks/graph_step.py [--rounds 200] [--device-lowering cpu|none] [--json out.json]``.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import encoder, sgd  # noqa: E402
from benchmarks.trainer_step import SMALL, autocast_step, lowering_of, time_steps, timing_parser, trainer_step  # noqa: E402
from converter.api import pipeline  # noqa: E402
from converter.options import ConvertOptions  # noqa: E402
from converter.train.trainer import MixedPrecisionTrainer  # noqa: E402

__all__ = ["build", "main"]


def _convert(model, x, *, level: str, lowering, simplify_graph: bool) -> torch.fx.GraphModule:
    options = ConvertOptions(precision="bf16", placement="mincut", keep_io_types=True, opt_level=level, device=lowering)
    captured, *_ = pipeline(copy.deepcopy(model), (x,), options, rules=None, simplify_graph=simplify_graph)
    return captured.gm


def build(*, lowering: str | None) -> dict:
    """name -> step(clock) for the variants, and the node counts of each converted graph."""
    model, x = encoder(*SMALL)
    steps, nodes = {"autocast": autocast_step(model, x)}, {}
    for level in ("O1", "O2"):
        for simplify_graph in (True, False):
            name = level + ("" if simplify_graph else "_raw")
            module = _convert(model, x, level=level, lowering=lowering, simplify_graph=simplify_graph)
            nodes[name] = len(module.graph.nodes)
            trainer = MixedPrecisionTrainer(module, sgd(module.parameters()), precision="bf16",
                                            master_weights=level == "O2")
            steps[name] = trainer_step(module, trainer, x)
    return steps, nodes


def main(argv: list[str] | None = None) -> dict:
    args = timing_parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    steps, nodes = build(lowering=lowering_of(args))
    return time_steps(steps, args, nodes=nodes)


if __name__ == "__main__":
    main()

"""The fp8 accuracy target (issue 34, deliverable 4): evaluations of the ranked search against graph-order bisection.

The model: transformers' ``LlamaForCausalLM`` from a small config (library defaults: SDPA attention, use_cache),
hidden 64, MLP 96, ``--layers`` decoder layers, converted with ``precision="fp8"`` and
``fp8_min_flops_per_token = 1024`` (the built-in size gate would keep this small model in bf16), so every
linear but the first (``fp8_keep_first``) and ``lm_head`` runs in fp8: 13 fp8 layers at 2 decoder layers.
Two of them are made deliberately sensitive (:func:`planted_llama`): a **dead input feature with a huge weight**.
Feature ``k`` of layer 0's ``v_proj`` input is always 0 (its RMSNorm gain is 0) and the weight column ``k``
holds one entry 10⁶ times the matrix's largest; likewise the last layer's ``down_proj`` reads an intermediate
feature that ``up_proj`` never writes. The fp32 model is unchanged by the huge entries (they multiply zeros),
but a tensorwise fp8 scale maps the outlier to 448, and the rest of the weight flushes to zero.

Batches: 4 of 2×16 tokens with an attention mask, the second row of each padded by 4. The conversion has no
calibration, so the per-layer SQNR-floor fallback (which would catch the planted layers on its own) does not
run: only the searches act.

For each tolerance, every method starts from the same converted graph, batches and fp32 reference outputs, and
counts *evaluations* (forward passes of the converted graph over the batches; the fp32 reference counts 1, a
ranking counts what it is charged):

* ``propagated`` (the default, :func:`converter.numerics.fp8_search.rank_fp8_layers`): each layer's fp8 error
  propagated to the outputs along a random direction (charged 4);
* ``layer_sqnr``: lowest per-layer output SQNR first (``measure_fp8_layers``; charged 6);
* ``graph_order``: the same search over the layers in graph order (no ranking);
* ``bisection``: onnxconverter-common's graph-order segment bisection (``bisect_graph_order``, its final
  validation included).

The ranked searches end by pruning to a fixed point (what ``fp8_accuracy_search`` does), so no kept layer can
go back to fp8 alone; the script checks that by evaluation (``minimal``, not counted). Bisection's set is not
pruned (onnxconverter-common's algorithm). It also times the ranking passes against one evaluation (CPU time, medians).

Run: ``PYTHONPATH=. python benchmarks/fp8_search.py [--layers 2 4] [--out benchmarks/results/fp8_search.json]``
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import converter  # noqa: E402
from converter.numerics.common import floating_outputs, json_float  # noqa: E402
from converter.numerics.fp8_search import (  # noqa: E402
    Fp8Evaluator,
    per_layer_db_ranking,
    propagated_ranking,
    prune_to_minimal,
)
from converter.numerics.search import bisect_graph_order, search_ranked  # noqa: E402

#: the rule file every conversion here uses: fp8 for this small model's GEMMs
RULES = "[settings]\nfp8_min_flops_per_token = 1024\n"
VOCAB, FACTOR, DEAD = 96, 1e6, 5
TOLERANCES = (15, 20, 25, 30, 33, 36, 40, 44)


def planted_llama(layers: int = 2, *, factor: float = FACTOR) -> tuple[torch.nn.Module, tuple, set[str]]:
    """The Llama with two planted sensitive fp8 layers (module docstring): (model, example (args, kwargs),
    the node names of the planted layers)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    first, last = model.model.layers[0], model.model.layers[-1]
    with torch.no_grad():
        first.input_layernorm.weight[DEAD] = 0.0  # feature DEAD never reaches q/k/v ...
        v = first.self_attn.v_proj.weight
        v[3, DEAD] = factor * v.abs().max()  # ... so this entry changes nothing in fp32
        last.mlp.up_proj.weight[DEAD] = 0.0  # intermediate feature DEAD is always 0 ...
        down = last.mlp.down_proj.weight
        down[3, DEAD] = factor * down.abs().max()
    planted = {"model_layers_0_self_attn_v_proj", f"model_layers_{layers - 1}_mlp_down_proj"}
    return model, batches(1)[0], planted


def batches(n: int = 4, *, seed: int = 5) -> list[tuple[tuple, dict]]:
    """``n`` padded batches of 2×16 tokens as ``((), {"input_ids", "attention_mask"})``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, -4:] = 0
        out.append(((), {"input_ids": torch.randint(2, VOCAB, (2, 16), generator=gen), "attention_mask": mask}))
    return out


def rules_file(directory: str, *, floors: bool = True) -> str:
    """The rule file: fp8 for these small GEMMs; ``floors=False`` also turns the per-layer SQNR floors of the
    calibration fallback off (the planted layers, 0 dB alone, are under them: the search is what is measured)."""
    path = Path(directory) / ("fp8_small.toml" if floors else "fp8_small_no_floors.toml")
    off = "".join(f"fp8_min_sqnr_{gemm} = -1000.0\n" for gemm in ("output", "grad_input", "grad_weight"))
    path.write_text(RULES + ("" if floors else off), encoding="utf-8")
    return str(path)


def fp32_outputs(model: torch.nn.Module, items: list) -> list[list[torch.Tensor]]:
    """The original model's floating outputs per batch: the reference every evaluation is judged against."""
    with torch.no_grad():
        return [[t.detach() for t in floating_outputs(model(*args, **kwargs))] for args, kwargs in items]


def _ranked_search(module, items, refs, tolerance, ranked: list[str], cost: int) -> dict:
    ev = Fp8Evaluator(module, items, refs, tolerance=tolerance)
    first = ev.evaluate_keep(())
    keep: list[str] = [] if first.ok else prune_to_minimal(ev.evaluate_keep, search_ranked(ev.evaluate_keep, ranked,
                                                                                           max_prune=len(ranked)))
    evaluations = 1 + ev.runs + (0 if first.ok else cost)
    minimal = all(not ev.evaluate_keep([x for x in keep if x != name]).ok for name in keep)  # checked, not counted
    return {"kept": keep, "evaluations": evaluations, "minimal": minimal, "sqnr_db": json_float(ev.evaluate_keep(keep).sqnr_db)}


def _bisection(module, items, refs, tolerance, layers: list[str]) -> dict:
    ev = Fp8Evaluator(module, items, refs, tolerance=tolerance)
    kept, attempts = bisect_graph_order(lambda keep: ev.evaluate_keep(keep, memo=False), layers)
    return {"kept": kept, "evaluations": 1 + attempts, "sqnr_db": json_float(ev.evaluate_keep(kept).sqnr_db)}


def _cpu_seconds(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def run_model(layers: int, tolerances) -> dict[str, Any]:
    """Every method at every tolerance on the planted Llama with ``layers`` decoder layers."""
    model, example, planted = planted_llama(layers)
    items = batches()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, example, precision="fp8", rules=[rules_file(tmp)])
    refs = fp32_outputs(model, items)
    ev = Fp8Evaluator(conv.module, items, refs, tolerance=0)
    rankings = {"propagated": propagated_ranking(), "layer_sqnr": per_layer_db_ranking()}
    orders = {name: rank(ev)[:2] for name, rank in rankings.items()}
    orders["graph_order"] = (list(ev.layers), 0)
    one = _cpu_seconds(lambda: ev.evaluate_keep((), memo=False))
    cost = {name: _cpu_seconds(lambda r=rank: r(ev)) / one for name, rank in rankings.items()}
    rows = []
    for tol in tolerances:
        row: dict[str, Any] = {"tolerance_db": tol}
        for name, (ranked, charged) in orders.items():
            row[name] = _ranked_search(conv.module, items, refs, tol, ranked, charged)
        row["bisection"] = _bisection(conv.module, items, refs, tol, list(ev.layers))
        rows.append(row)
        print(f"L{layers} {tol:>3} dB: " + ", ".join(f"{k} {v['evaluations']} ({len(v['kept'])} kept)"
                                                      for k, v in row.items() if isinstance(v, dict)), flush=True)
    return {"decoder_layers": layers, "fp8_layers": len(ev.layers), "planted": sorted(planted),
            "all_fp8_sqnr_db": json_float(ev.evaluate_keep(()).sqnr_db),
            "all_bf16_sqnr_db": json_float(ev.evaluate_keep(ev.layers).sqnr_db),
            "ranking_head": {name: ranked[:4] for name, (ranked, _) in orders.items() if name != "graph_order"},
            "ranking_cpu_cost_in_evaluations": {k: round(v, 1) for k, v in cost.items()},
            "ranking_charged": {name: orders[name][1] for name in rankings}, "rows": rows}


def markdown(result: dict) -> str:
    """The results as Markdown tables, one per model."""
    methods = ("propagated", "layer_sqnr", "graph_order", "bisection")
    lines = [f"# fp8 accuracy target: evaluations to the fewest bf16 layers ({result['date']}, torch {result['torch']})", ""]
    for model in result["models"]:
        lines += [f"## Llama, {model['decoder_layers']} decoder layers: {model['fp8_layers']} fp8 layers, planted "
                  f"{', '.join(model['planted'])}", "",
                  f"All fp8: {model['all_fp8_sqnr_db']:.1f} dB; every fp8 layer in bf16: {model['all_bf16_sqnr_db']:.1f} dB. "
                  f"Rankings charged {model['ranking_charged']} evaluations; measured CPU time "
                  f"{model['ranking_cpu_cost_in_evaluations']} evaluations.", "",
                  "| tolerance (dB) | " + " | ".join(f"{m}: evaluations (kept)" for m in methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for row in model["rows"]:
            cells = [f"{row[m]['evaluations']} ({len(row[m]['kept'])}{'' if row[m].get('minimal', True) else ', not minimal'})"
                     for m in methods]
            lines.append(f"| {row['tolerance_db']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tolerances", type=float, nargs="+", default=list(TOLERANCES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_search.json"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.processor() or platform.machine(),
              "models": [run_model(n, ns.tolerances) for n in ns.layers]}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

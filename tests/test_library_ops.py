"""Custom ops of other libraries: transformers 5 runs MoE experts through its own
``torch.ops.transformers.grouped_mm_fallback``. The conversion treats it as the grouped matmul it
is (rules, FLOPs, O2 storage), reports it, and says that model.py needs the library that defines it."""
from __future__ import annotations

import math

import pytest
import torch

import converter
from converter.ir.meta import META_DECISION, META_INFO

transformers = pytest.importorskip("transformers")


def _sqnr(ref, out) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    noise = (ref - out).norm()
    return math.inf if noise == 0 else float(20 * torch.log10(ref.norm() / noise))


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_hf_moe_experts_run_in_half_and_are_counted():
    model = _mixtral()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    conv = converter.convert(model, ((ids,), {}))
    experts = [n for n in conv.module.graph.nodes if n.meta.get(META_INFO) is not None and n.meta[META_INFO].op == "grouped_mm"]
    assert [str(n.target) for n in experts] == ["transformers.grouped_mm_fallback.default"] * 4, [str(n.target) for n in experts]
    for node in experts:
        decision = node.meta[META_DECISION]
        assert decision.precision == "bf16" and str(decision.rule) == "default.toml:[op].grouped_mm", (node.name, decision)
    # FLOPs: 2 · S · N · K with S = 2·12 tokens × top-2 rows; gate_up is 64 -> 2·96, down is 96 -> 64
    rows = {r["name"]: r for r in conv.report.nodes}
    flops = [rows[n.name]["flops"] for n in experts]
    assert flops == [2 * 48 * 192 * 64, 2 * 48 * 64 * 96] * 2, flops
    summary = conv.report.summary
    assert "grouped_mm_fallback" not in summary["unmatched_ops"] and summary["half_flop_fraction"] == 1.0, summary
    assert conv.report.records.lowering.library_ops == [{"op": "transformers::grouped_mm_fallback", "module": "transformers.integrations.moe",
                                                 "package": "transformers", "nodes": 4}]
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(ids).logits
        out = conv.module(ids)["logits"]
    ours, theirs = _sqnr(ref, out), _sqnr(ref, amp)
    assert ours >= theirs - 1.0, f"converted {ours:.1f} dB vs autocast {theirs:.1f} dB"
    # O2 stores the expert weights in half: the grouped matmul reads them as weights
    o2 = converter.convert(model, ((ids,), {}), opt_level="O2")
    dtypes = o2.module.meta["mp_param_dtypes"]
    experts = {k: v for k, v in dtypes.items() if ".experts." in k}
    assert len(experts) == 4 and set(experts.values()) == {torch.bfloat16}, experts


def test_model_py_names_the_package_a_library_op_needs(tmp_path):
    """model.py imports the module that registers the custom op (so it runs where transformers is
    installed, bit-identical), says so in its docstring, and fails with one clear line elsewhere;
    the CLI's emit notes say it once."""
    import importlib.util
    import subprocess
    import sys

    model = _mixtral()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    conv = converter.convert(model, ((ids,), {}))
    notes: list[str] = []
    from converter.export.emit import emit

    emit(conv, tmp_path / "out", messages=notes)
    needs = [n for n in notes if n.startswith("model.py needs the package 'transformers'")]
    assert len(needs) == 1 and "torch.ops.transformers.grouped_mm_fallback" in needs[0], notes
    source = (tmp_path / "out" / "model.py").read_text()
    assert "Depends on torch and transformers (custom ops)" in source and "import transformers.integrations.moe" in source
    spec = importlib.util.spec_from_file_location("moe_emitted", tmp_path / "out" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.no_grad():
        assert torch.equal(module.load()(ids)["logits"], conv.module(ids)["logits"])
    # without transformers: one clear ImportError naming the package
    blocker = "import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n" \
              "        if name.split('.')[0] == 'transformers':\n            raise ImportError('blocked')\n" \
              "sys.meta_path.insert(0, _Block())\n"
    run = subprocess.run([sys.executable, "-c", blocker + f"import runpy; runpy.run_path({str(tmp_path / 'out' / 'model.py')!r})"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: model.py calls torch.ops.transformers.grouped_mm_fallback, which the package "
                    "'transformers' defines: pip install transformers"), run.stderr[-1500:]

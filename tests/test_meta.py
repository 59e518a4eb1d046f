"""Models larger than memory: converted without their weights (parameters on the meta device), model.py
loads them from the user's checkpoint (save_pretrained folder, sharded or not) memory-mapped."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import converter
from converter.cli.main import main

transformers = pytest.importorskip("transformers")

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, tie_word_embeddings=False)  # SDPA and use_cache=True as shipped


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_empty_weights_builds_without_memory_and_keeps_buffers():
    with converter.empty_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}  # the rotary inv_freq is computed, not loaded
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_converted_without_weights_loads_a_sharded_checkpoint_bit_exactly(tmp_path, opt_level):
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).eval()
    real.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with converter.empty_weights():
        empty = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).eval()
    conv = converter.convert(empty, ((ids,), {}), opt_level=opt_level)
    notes: list[str] = []
    from converter.export.emit import emit

    emit(conv, tmp_path / "out", messages=notes)
    assert any(n.startswith("model.py takes 21 tensors from a checkpoint of yours") for n in notes), notes
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["summary"]["compute_nodes"] > 0
    module = _load(tmp_path / "out", f"meta_{opt_level}")
    assert len(module.EXTERNAL) == 21
    with pytest.raises(ValueError, match="converted without its weights"):
        module.load()
    loaded = module.load(weights=tmp_path / "ckpt")
    reference = converter.convert(real, ((ids,), {}), opt_level=opt_level)
    if opt_level == "O2":  # stored in half: the checkpoint's fp32 weights were converted at load
        half = {n for n, d in module.PARAM_STORAGE_DTYPES.items() if d == torch.bfloat16}
        assert half and all(loaded.get_parameter(n).dtype == torch.bfloat16 for n in half)
    with torch.no_grad():
        assert torch.equal(loaded(ids)["logits"], reference.module(ids)["logits"])
    x = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(x)["logits"], reference.module(x)["logits"])


def test_cli_converts_a_checkpoint_folder_without_its_weights(tmp_path, capfd):
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).eval()
    real.save_pretrained(tmp_path / "ckpt")
    code = main([str(tmp_path / "ckpt"), "--empty-weights", "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "converted without its weights (--empty-weights)" in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists() or "model.py takes" in err
    module = _load(tmp_path / "out", "meta_cli")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)  # the folder's model takes its forward's attention_mask (issue 30.3)
    from converter.cli.hfmodel import load_pretrained_folder

    reference = converter.convert(real, load_pretrained_folder(tmp_path / "ckpt").example_inputs)
    with torch.no_grad():
        assert torch.equal(module.load(weights=tmp_path / "ckpt")(ids, mask)["logits"], reference.module(ids, mask)["logits"])


@pytest.mark.slow
def test_llama3_8b_shape_converts_from_a_config_only_folder_in_little_memory(tmp_path):
    """A Llama-3-8B-shaped config with no weights: `mpconvert FOLDER` builds it on the meta device
    (the default for a config-only folder) and writes model.py, train.py and the reports; the
    process's peak RSS stays under 3 GiB (the fp32 weights would be 30 GiB)."""
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      tie_word_embeddings=False, rope_theta=500000.0,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path / "llama3_8b")
    # the child reports its own peak (RUSAGE_CHILDREN would be the largest of every earlier child too)
    script = ("import resource, runpy, sys\n"
              f"sys.argv = ['mpconvert', {str(tmp_path / 'llama3_8b')!r}, '--out', {str(tmp_path / 'out')!r}]\n"
              "try:\n    runpy.run_module('converter', run_name='__main__')\n"
              "finally:\n    print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    peak = int(next(line.split()[1] for line in run.stderr.splitlines() if line.startswith("PEAK_KIB")))
    assert run.returncode == 0, run.stderr[-2000:]
    assert {"model.py", "train.py", "report.json", "report.md", "report.html"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "converted without its weights (the folder has no weight files" in run.stderr, run.stderr
    assert peak < 3 * 2**20, f"peak RSS {peak / 2**20:.2f} GiB"  # ru_maxrss is in KiB on Linux
    source = (tmp_path / "out" / "model.py").read_text()
    assert "EXTERNAL = [" in source and "'model.layers.31.mlp.down_proj.weight'" in source

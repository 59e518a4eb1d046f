"""Issue 16.2-16.4: repeatable --rules, the training-device flag, audit wording, explain from the saved
report (no torch import, closest names), and save_pretrained folders as models."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import ROOT, SAMPLES
from tests.test_cli import assert_bad_input, run, snapshot

MLP = str(SAMPLES / "mlp.py")


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _rule_files(report_dir) -> list[str]:
    return json.loads((report_dir / "report.json").read_text())["rules"]["files"]


def test_rules_repeat_before_or_after_the_model(work, capfd):
    (work / "mine.toml").write_text('[module]\n"head" = "fp32"\n')
    code, out, err = run(capfd, "--rules", "llm", MLP, "--rules", "mine.toml", "--out", "a", "--no-measure", "-q")
    assert code == 0, err
    assert _rule_files(work / "a") == ["default.toml", "llm.toml", "mine.toml"]
    assert "deprecated" not in err
    # the old spelling still works, with a deprecation message, and no longer swallows MODEL.py
    code, out, err = run(capfd, "--rules", "llm", "mine.toml", MLP, "--out", "b", "--no-measure")
    assert code == 0, err
    assert "`--rules F1 F2 ...` is deprecated" in err and "--rules F1 --rules F2" in err
    assert _rule_files(work / "b") == ["default.toml", "llm.toml", "mine.toml"]
    code, out, err = run(capfd, MLP, "--rules", "llm", "mine.toml", "--out", "c", "--no-measure")
    assert code == 0 and "deprecated" in err, err
    assert _rule_files(work / "c") == ["default.toml", "llm.toml", "mine.toml"]


def test_tune_for_is_a_deprecated_alias_of_device(work, capfd):
    code, out, err = run(capfd, MLP, "--tune-for", "cpu", "--no-measure")
    assert code == 0, err
    assert "--tune-for is deprecated; use --device cpu" in err
    assert json.loads((work / "mlp_mp" / "report.json").read_text())["device"] == "cpu"
    assert_bad_input(*run(capfd, MLP, "--tune-for", "cpu", "--device", "cuda", "--out", "x"), "contradicts --device cuda")
    code, out, _ = run(capfd, "--help")
    assert "--tune-for" not in out and "the device the model will train on" in out


def test_audit_speaks_as_an_audit(work, capfd):
    code, out, err = run(capfd, "audit", MLP)
    assert code == 0, err
    first = out.strip().splitlines()[0]
    assert first.startswith("Audit (bf16): ") and "would run in half" in first and "nothing was converted" in first, first
    assert "Converted" not in out
    code, out, err = run(capfd, "audit", MLP, "--json", "--out", "j")
    assert json.loads(out)["line"].startswith("Audit (bf16): ")


def _explain_in_subprocess(cwd, *args) -> tuple[int, str, str, bool, float]:
    """Run explain in a fresh interpreter; report whether torch got imported."""
    code = ("import sys, json; from converter.cli.main import main; c = main(sys.argv[1:]); "
            "print(json.dumps({'torch': 'torch' in sys.modules}), file=sys.stderr); raise SystemExit(c)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    flag = json.loads(proc.stderr.strip().splitlines()[-1])["torch"]
    return proc.returncode, proc.stdout, proc.stderr, flag, elapsed


def test_explain_reads_the_saved_report_without_torch(work, capfd):
    code, out, err = run(capfd, "audit", MLP, "--rules", "llm", "--out", "aud")
    assert code == 0, err
    code, out, err, torch_imported, elapsed = _explain_in_subprocess(work, "explain", "aud", "fc1")
    assert code == 0, err
    assert "fc1: op linear" in out and "WINS" in out and "precedence, highest first" in out
    assert not torch_imported, f"explain from report.json imported torch ({elapsed:.2f} s)"
    # the same text as explaining the conversion in memory
    import converter
    from converter.report.render import explain
    from tests.helpers import load_sample

    sample = load_sample("mlp")
    report = converter.audit(sample.build_model(), sample.example_inputs(), rules="llm")
    assert out.strip() == explain(report, "fc1").strip()
    code, out, err = run(capfd, "explain", "aud", "fc1", "--json")
    payload = json.loads(out)
    assert payload["ok"] and payload["source"].endswith("report.json") and payload["precision"] == "bf16"
    assert payload["matches"][0]["level"] == "op" and payload["matches"][0]["precision"] == "half", payload["matches"]
    # unknown node: the closest names
    code, out, err, _, _ = _explain_in_subprocess(work, "explain", "aud", "fc_1")
    assert code == 2 and "Traceback" not in err
    assert "did you mean 'fc1'" in err and "'fc2'" in err, err


def test_explain_model_file_reuses_a_fresh_report(work, capfd):
    shutil.copy(MLP, work / "mlp.py")
    code, out, err = run(capfd, "mlp.py", "--rules", "llm", "--no-measure", "-q")
    assert code == 0, err
    code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head", "--rules", "llm")
    assert code == 0 and "explained from" in err and "mlp_mp" in err, err
    assert not torch_imported
    # other options: the saved report does not fit, so the model is audited afresh
    code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head")
    assert code == 0 and "fresh audit" in err and torch_imported, err
    # a model file changed after the report: not fresh
    later = time.time() + 5
    os.utime(work / "mlp.py", (later, later))
    code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head", "--rules", "llm")
    assert code == 0 and "fresh audit" in err, err
    assert snapshot(work) == sorted(["mlp.py", "mlp_mp", *(f"mlp_mp/{n}" for n in os.listdir(work / "mlp_mp"))])


# ---------------------------------------------------------------------------------------------
# save_pretrained folders (issue 16.2)


def _save(kind: str, folder) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "bert":
        config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=32)
        model = transformers.BertModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=128, num_labels=3)
        model = transformers.ViTForImageClassification(config)
    model.save_pretrained(folder)


@pytest.mark.parametrize("kind, auto, shape", [
    ("gpt2", "AutoModelForCausalLM", {"input_ids": (3, 8), "attention_mask": (3, 8)}),  # the forward's inputs (issue 30.3)
    ("bert", "AutoModel", {"input_ids": (3, 8), "attention_mask": (3, 8), "token_type_ids": (3, 8)}),
    ("vit", "AutoModelForImageClassification", {"pixel_values": (3, 3, 32, 32)}),
])
def test_save_pretrained_folder_converts_offline(work, capfd, monkeypatch, kind, auto, shape):
    from converter.cli.hfmodel import load_pretrained_folder

    _save(kind, work / kind)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_pretrained_folder(work / kind, batch=3, seq_len=8)
    assert loaded.entry == f"{auto}.from_pretrained"
    assert {k: tuple(v.shape) for k, v in loaded.example_inputs[1].items()} == shape
    code, out, err = run(capfd, kind, "--batch", "3", "--seq-len", "8", "--json", "--no-measure")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["out"] == str(work / f"{kind}_mp") and payload["summary"]["by_precision"]["bf16"] > 0
    assert any("bit-exactly" in c for c in payload["checks"]), payload["checks"]
    report = json.loads((work / f"{kind}_mp" / "report.json").read_text())
    assert report["tracer"] == "export"


def test_rotary_decoder_folder_audits(work, capfd):
    """A Llama folder builds and audits; converting it (emitting model.py) waits on capture's work
    for the rotary embedding's nested graph, and is refused with one line meanwhile."""
    _save("llama", work / "llama")
    capfd.readouterr()
    code, out, err = run(capfd, "audit", "llama", "--seq-len", "12", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["tracer"] == "export" and payload["summary"]["by_precision"]["bf16"] > 0
    code, out, err = run(capfd, "explain", "llama_audit", "lm_head")
    assert code == 0 and "lm_head: op linear" in out, err


def test_folder_errors_are_one_line(work, capfd):
    (work / "broken").mkdir()
    (work / "broken" / "config.json").write_text("{not json")
    assert_bad_input(*run(capfd, "broken"), "config.json", "save_pretrained")
    (work / "nomodel").mkdir()
    (work / "nomodel" / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    # a config-only folder converts without weights (tests/test_meta.py); asked to load them, it is bad input
    assert_bad_input(*run(capfd, "nomodel", "--load-weights", "--out", "o"), "nomodel", "cannot build a model")
    _save("bert", work / "bert")
    capfd.readouterr()  # save_pretrained's progress bar
    assert_bad_input(*run(capfd, "bert", "--seq-len", "64", "--out", "o"), "--seq-len 64 exceeds the model's 32 positions")
    assert not (work / "o").exists()


def test_explain_reuses_a_fresh_report_for_any_spelling_of_its_precision(work, capfd):
    """Issue 33: `--precision bfloat16` is the report's `bf16`; the raw spelling never matched, so the
    saved report was never reused and the model was audited afresh (importing torch)."""
    shutil.copy(MLP, work / "mlp.py")
    code, out, err = run(capfd, "audit", "mlp.py", "-q")
    assert code == 0, err
    for spelling in ("bfloat16", "BF16", "bf16-mixed"):
        code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head", "--precision", spelling)
        assert code == 0 and "explained from" in err and "mlp_audit" in err, (spelling, err)
        assert not torch_imported, spelling
    # another precision: the saved bf16 report does not fit
    code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head", "--precision", "half")
    assert code == 0 and "fresh audit" in err and torch_imported, err
    # an unknown name is the shared one-line message, also on this path
    code, out, err, _, _ = _explain_in_subprocess(work, "explain", "mlp.py", "head", "--precision", "bf8")
    assert code == 2 and "unknown precision 'bf8'" in err and "Traceback" not in err, err


def test_audit_honours_opt_level(work, capfd):
    """Issue 33: `audit --opt-level O2` wrote an O1 report; it computes as convert(opt_level="O2") does."""
    import converter
    from tests.helpers import load_sample

    code, out, err = run(capfd, "audit", MLP, "--opt-level", "O2", "--out", "o2", "-q")
    assert code == 0, err
    report = json.loads((work / "o2" / "report.json").read_text())
    assert report["opt_level"] == "O2" and report["summary"]["opt_level"] == "O2", (report["opt_level"], report["summary"]["opt_level"])
    sample = load_sample("mlp")
    converted = converter.convert(sample.build_model(), sample.example_inputs(), opt_level="O2").report.summary
    keys = ("opt_level", "casts", "cast_bytes", "weight_casts_dropped_in_o2", "by_precision")
    assert {k: report["summary"][k] for k in keys} == {k: converted[k] for k in keys}
    assert converted["weight_casts_dropped_in_o2"] == 6, converted["weight_casts_dropped_in_o2"]
    # explain audits with the same opt level, so an O2 report is reused for --opt-level O2 only
    code, out, err = run(capfd, "audit", MLP, "--opt-level", "O2", "-q")
    assert code == 0, err
    code, out, err, torch_imported, _ = _explain_in_subprocess(work, "explain", MLP, "head", "--opt-level", "O2")
    assert code == 0 and "explained from" in err and not torch_imported, err
    api = converter.audit(sample.build_model(), sample.example_inputs(), opt_level="O2")
    assert api.summary["opt_level"] == "O2" and api.records.run.opt_level == "O2"

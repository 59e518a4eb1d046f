"""Issue 44.5: names are data.

ESC/BEL bytes from rule reasons, module names, file names and a hand-edited report.json reached the
terminal and report.md raw (a rule reason could recolour the terminal or hide a line). Every terminal
and Markdown writer now escapes control bytes (``\\x1b``): the bytes never appear, their escapes do.
"""
from __future__ import annotations

import json

from tests.test_cli import run, write

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.add_module("odd\\x1b]0;owned\\x07", nn.Linear(16, 4))

    def forward(self, x):
        return getattr(self, "odd\\x1b]0;owned\\x07")(torch.relu(self.fc(x)))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(2, 8),)
"""

RULES = '''
[op]
relu = { precision = "fp32", reason = "kept \\u001b[2J\\u001b[31mred\\u0007 on purpose" }
'''

CONTROL = ("\x1b", "\x07")


def _clean(text: str, where: str) -> None:
    for byte in CONTROL:
        assert byte not in text, f"{where} holds the raw control byte {byte!r}: {text[:400]!r}"


def test_rule_reasons_and_module_names_reach_report_md_and_the_terminal_escaped(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    out = tmp_path / "out"
    code, stdout, stderr = run(capfd, model, "--rules", rules, "--out", out, "--no-measure")
    assert code == 0, stderr
    _clean(stdout, "stdout")
    _clean(stderr, "stderr")
    md = (out / "report.md").read_text()
    _clean(md, "report.md")
    assert "\\x1b" in md and "red\\x07 on purpose" in md, "the reason is shown, escaped"
    code, stdout, stderr = run(capfd, "explain", out, "relu")
    assert code == 0, stderr
    _clean(stdout + stderr, "explain")
    assert "\\x1b" in stdout and "red\\x07" in stdout, stdout


def test_a_hand_edited_report_json_is_shown_escaped(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL.replace('"odd\\x1b]0;owned\\x07"', '"head"'))
    out = tmp_path / "out"
    code, _, stderr = run(capfd, model, "--out", out, "--no-measure")
    assert code == 0, stderr
    path = out / "report.json"
    report = json.loads(path.read_text())
    for node in report["nodes"]:
        node["reason"] = "edited \x1b[8mhidden\x1b[0m \x07"
        node["name"] = node["name"] + ("\x1b[2K" if node["name"] == "relu" else "")
    path.write_text(json.dumps(report))
    code, stdout, stderr = run(capfd, "explain", out, "relu\x1b[2K")
    _clean(stdout + stderr, "explain of a hand-edited report.json")
    assert "\\x1b" in stdout + stderr


def test_a_file_name_with_control_bytes_is_escaped_in_errors(tmp_path, capfd):
    code, stdout, stderr = run(capfd, tmp_path / "no\x1b[31mfile\x07.py", "--out", tmp_path / "o")
    assert code == 2, stderr
    _clean(stderr, "the error line")
    assert "\\x1b[31mfile\\x07" in stderr, stderr


HOSTILE = '''
import torch
from torch import nn

Block = type('Bl"ock\\nClass', (nn.Module,), {
    "__init__": lambda self: (nn.Module.__init__(self), setattr(self, "proj", nn.Linear(8, 8)))[0],
    "forward": lambda self, x: self.proj(x),
})


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module('we"ird\\n\\x1b[31mname\\'', Block())
        self.register_parameter('p"q\\nr\\\\', nn.Parameter(torch.linspace(0.5, 1.5, 8)))
        self.tail = nn.Linear(8, 4)

    def forward(self, x):
        h = getattr(self, 'we"ird\\n\\x1b[31mname\\'')(x) * getattr(self, 'p"q\\nr\\\\')
        return self.tail(torch.relu(h))


def build_model():
    torch.manual_seed(0)
    return Odd()


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_codegen_writes_any_module_parameter_and_class_name_as_data(tmp_path, capfd):
    import importlib.util

    import torch

    model = write(tmp_path, "odd.py", HOSTILE)
    out = tmp_path / "out"
    code, stdout, stderr = run(capfd, model, "--out", out, "--no-measure")
    assert code == 0, stderr  # it was exit 3: a SyntaxError in torch.fx's generated code
    _clean(stdout + stderr, "the terminal")
    for name in ("model.py", "train.py"):
        compile((out / name).read_text(), name, "exec")
    spec = importlib.util.spec_from_file_location("odd_mp", out / "model.py")
    emitted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emitted)
    net = emitted.load(device="cpu")
    names = dict(net.named_parameters())
    assert 'p"q\nr\\' in names and 'we"ird\n\x1b[31mname\'.proj.weight' in names, sorted(names)
    spec = importlib.util.spec_from_file_location("odd_src", model)
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    reference = source.build_model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    got, want = net(x), reference(x)
    err = float((got.float() - want).abs().max())
    assert err < 0.05 * float(want.abs().max()), f"model.py's output is {err:.3g} from fp32 (bf16 should be ~1e-2 relative)"
    got.float().sum().backward()
    grad = names['p"q\nr\\'].grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0

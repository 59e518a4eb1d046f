"""Issue 44.2: calibration input is validated as model input is.

``--calibration-data`` (and a model file's ``calibration_inputs()``) is read up to a documented bound
(an endless generator stops there, and the CLI says so); a batch with the wrong feature size or token
ids past the vocabulary is one line, exit 2 (it was an internal error, exit 3); NaN/inf and empty
batches are named (exit 2); two safetensors names for one input (``x`` and ``0.x``) are an error;
a ``.py`` inside a checkpoint folder needs ``--trust-remote-code``, and ``--help`` says a .py is imported.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from converter.cli.calibdata import MAX_CALIBRATION_BATCHES
from tests.test_cli import assert_bad_input, run, write

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(8, 32),)
"""

TOKENS = """
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        return self.proj(self.emb(ids))


def build_model():
    torch.manual_seed(0)
    return Tagger()


def example_inputs():
    return (torch.randint(0, 50, (2, 6)),)
"""


def _convert(capfd, tmp_path, model, data, *extra):
    return run(capfd, model, "--calibration-data", data, "--out", tmp_path / "out", "--no-measure", *extra)


def test_an_endless_generator_stops_at_the_bound_and_says_so(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    # the generator raises once it is read well past the bound: reading it all (the old behaviour) fails
    data = write(tmp_path, "endless.py", f"""
        import itertools
        import torch

        def calibration_inputs():
            for i in itertools.count():
                if i > {MAX_CALIBRATION_BATCHES} + 50:
                    raise MemoryError("read past the bound")
                yield (torch.randn(8, 32),)
        """)
    code, out, err = _convert(capfd, tmp_path, model, data)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["calibration"]["batches"] == MAX_CALIBRATION_BATCHES, report["calibration"]
    assert f"more than {MAX_CALIBRATION_BATCHES} batches" in err, err


def test_the_model_files_own_calibration_inputs_are_bounded_too(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL + f"""

def calibration_inputs():
    i = 0
    while True:
        i += 1
        if i > {MAX_CALIBRATION_BATCHES} + 50:
            raise MemoryError("read past the bound")
        yield (torch.randn(8, 32),)
""")
    code, out, err = run(capfd, model, "--calibrate", "--out", tmp_path / "out", "--no-measure")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["calibration"]["batches"] == MAX_CALIBRATION_BATCHES, report["calibration"]


def test_a_wrong_feature_size_is_bad_input_not_an_internal_error(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    data = write(tmp_path, "wide.py", """
        import torch

        def calibration_inputs():
            return [(torch.randn(8, 32),), (torch.randn(8, 33),)]
        """)
    line = assert_bad_input(*_convert(capfd, tmp_path, model, data), "batch 1")
    assert "8×33" in line and "8×32" in line, line
    assert not (tmp_path / "out").exists()


def test_token_ids_past_the_vocabulary_are_bad_input(tmp_path, capfd):
    model = write(tmp_path, "tagger.py", TOKENS)
    data = write(tmp_path, "ids.py", """
        import torch

        def calibration_inputs():
            return [(torch.randint(0, 50, (2, 6)),), (torch.full((2, 6), 70),)]
        """)
    line = assert_bad_input(*_convert(capfd, tmp_path, model, data), "batch 1")
    assert "70" in line and "50" in line, line
    assert not (tmp_path / "out").exists()


def test_token_ids_past_a_checkpoints_vocabulary_are_named_before_converting(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32)).save_pretrained(tmp_path / "bert")
    ids = torch.randint(1, 128, (2, 16))
    ids[1, 3] = 128
    save_file({"0.input_ids": ids, "0.attention_mask": torch.ones(2, 16, dtype=torch.long),
               "0.token_type_ids": torch.zeros(2, 16, dtype=torch.long)}, str(tmp_path / "calib.safetensors"))
    capfd.readouterr()
    line = assert_bad_input(*_convert(capfd, tmp_path, tmp_path / "bert", tmp_path / "calib.safetensors"),
                            "batch 0", "input_ids")
    assert "128" in line, line


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_batches_are_named(tmp_path, capfd, value):
    model = write(tmp_path, "net.py", MODEL)
    data = write(tmp_path, "bad.py", f"""
        import torch

        def calibration_inputs():
            x = torch.randn(8, 32)
            x[2, 5] = float("{value}")
            return [(torch.randn(8, 32),), (torch.randn(8, 32),), (x,)]
        """)
    line = assert_bad_input(*_convert(capfd, tmp_path, model, data), "batch 2")
    assert ("1 NaN" if value == "nan" else "1 inf") in line, line
    assert not (tmp_path / "out").exists()


def test_an_empty_batch_is_named(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    save_file({"0.x": torch.randn(8, 32), "1.x": torch.randn(0, 32)}, str(tmp_path / "calib.safetensors"))
    line = assert_bad_input(*_convert(capfd, tmp_path, model, tmp_path / "calib.safetensors"), "batch 1", "empty")
    assert "(0, 32)" in line, line


def test_two_names_for_one_input_are_an_error(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    save_file({"x": torch.randn(8, 32), "0.x": torch.randn(8, 32), "1.x": torch.randn(8, 32), "2.x": torch.randn(8, 32)},
              str(tmp_path / "calib.safetensors"))
    line = assert_bad_input(*_convert(capfd, tmp_path, model, tmp_path / "calib.safetensors"), "'x'", "'0.x'")
    assert "batch 0" in line, line
    assert not (tmp_path / "out").exists()


def test_a_py_inside_a_checkpoint_folder_needs_trust_remote_code(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    marker = tmp_path / "ran"
    data = write(folder, "calib.py", f"""
        import pathlib
        import torch

        pathlib.Path({str(marker)!r}).write_text("imported")

        def calibration_inputs():
            return [(torch.randn(8, 32),)]
        """)
    line = assert_bad_input(*_convert(capfd, tmp_path, model, data), "--trust-remote-code")
    assert "calib.py" in line, line
    assert not marker.exists(), "the .py ran without --trust-remote-code"
    code, out, err = _convert(capfd, tmp_path, model, data, "--trust-remote-code")
    assert code == 0, err
    assert marker.read_text() == "imported"


def test_help_says_a_py_calibration_file_is_imported(capfd):
    code, out, err = run(capfd, "--help")
    assert code == 0, err
    text = " ".join(out.split())
    start = text.index("--calibration-data FILE calibration batches")
    assert "imported" in text[start:start + 700] and "--trust-remote-code" in text[start:start + 700], text[start:start + 700]


def test_the_python_api_reads_an_endless_calibration_generator_up_to_its_bound():
    """``converter.convert(calibration=<endless generator>)`` stops at the documented bound with a warning (it was read
    until memory ran out); ``max_batches`` chooses another bound, silently."""
    import itertools
    import warnings

    import converter
    from converter import api

    assert api.MAX_CALIBRATION_BATCHES == MAX_CALIBRATION_BATCHES  # the CLI's bound and the API's are one
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    drawn = itertools.count()

    def endless():
        while True:
            next(drawn)
            yield (torch.randn(2, 8),)

    with pytest.warns(UserWarning, match=f"more than {MAX_CALIBRATION_BATCHES} batches"):
        conv = converter.convert(model, (torch.randn(2, 8),), calibration=endless(),
                                 calibration_options={"progress": False})
    assert len(conv.calibration) == MAX_CALIBRATION_BATCHES and next(drawn) == MAX_CALIBRATION_BATCHES + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        conv = converter.convert(model, (torch.randn(2, 8),), calibration=endless(),
                                 calibration_options={"progress": False, "max_batches": 3})
    assert len(conv.calibration) == 3

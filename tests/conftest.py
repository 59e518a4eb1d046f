"""Shared fixtures, the hypothesis profile, CI's no-skip guard and the ``--plant-fp32`` option."""
import importlib
import os

import pytest
import torch
from hypothesis import settings

# CI must be reproducible: the same examples on every run (and no example database). Locally the
# fuzzers keep exploring new examples; `HYPOTHESIS_PROFILE=ci` reproduces CI's run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") == "true" or os.environ.get("HYPOTHESIS_PROFILE") == "ci":
    settings.load_profile("ci")

# The suite's conversions are deterministic without any environment variable (no conversion reads one): every
# ConvertOptions built in this process (convert, audit, apply, the in-process CLI) defaults to no device profile
# (fixed kernel choices, no slow-half advice: expected output must not depend on the CPU that runs the suite)
# and lints the graph after each rewriting pass. A test that wants the product's defaults passes them
# (device_profile="auto"). CLI runs in a subprocess pass `--device-profile none`.
SUITE_OPTION_DEFAULTS = {"device_profile": None, "check_graph": True}
# The emitted model's run-time kernel switch (converter/kernels/upcast.py; no conversion reads it): the converted
# modules, the fresh model.py copies a test imports and child processes all run the native half kernels, so that
# the suite's numbers do not depend on which CPU runs it. tests/test_dispatch.py measures without it.
os.environ.setdefault("MPCONVERT_NO_DEVICE_ADVICE", "1")


def _suite_option_defaults() -> None:
    import dataclasses

    from converter.options import ConvertOptions

    init = ConvertOptions.__init__
    names = [f.name for f in dataclasses.fields(ConvertOptions)]
    defaults = list(init.__defaults__ or ())
    first = len(names) - len(defaults)  # the fields that have defaults: all of them
    for name, value in SUITE_OPTION_DEFAULTS.items():
        defaults[names.index(name) - first] = value
    init.__defaults__ = tuple(defaults)


_suite_option_defaults()

#: the top-level modules of pyproject.toml's `.[test]` extra: under CI (CI=true) a test that would skip because
#: one of them does not import fails instead (a broken install must not turn into skips)
TEST_EXTRA_MODULES = frozenset({
    "pytest", "xdist", "hypothesis", "transformers", "sklearn", "matplotlib", "onnx", "onnxruntime", "onnxscript",
    "accelerate", "pytorch_lightning", "lightning", "peft", "diffusers",
})
_importorskip = pytest.importorskip


def _importorskip_unless_ci(modname, minversion=None, reason=None, **kwargs):
    if os.environ.get("CI") == "true" and modname.split(".")[0] in TEST_EXTRA_MODULES:
        try:
            importlib.import_module(modname)
        except ImportError as exc:
            pytest.fail(f"CI=true: {modname!r} of the .[test] extra does not import ({exc}); "
                        "pip install -e '.[test]' (the suite must not skip it)", pytrace=False)
    return _importorskip(modname, minversion=minversion, reason=reason, **kwargs)


pytest.importorskip = _importorskip_unless_ci


def pytest_addoption(parser):
    parser.addoption("--plant-fp32", action="store_true",
                     help="plant a conversion that leaves every op in fp32 (tests/plant.py): the numeric tests must fail")


def pytest_configure(config):
    import plant

    if config.getoption("--plant-fp32"):
        os.environ[plant.ENV] = "1"
    if plant.planted():
        plant.install()


@pytest.fixture
def one_thread():
    """fp16 GEMMs on this CPU run an OpenMP region that stalls for milliseconds when a core is busy;
    tiny fp16 tests run far faster (and more predictably) on one intra-op thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

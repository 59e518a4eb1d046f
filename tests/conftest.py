"""Shared fixtures and the hypothesis profile."""
import os
import tempfile

import pytest
import torch
from hypothesis import settings

# CI must be reproducible: the same examples on every run (and no example database). Locally the
# fuzzers keep exploring new examples; `HYPOTHESIS_PROFILE=ci` reproduces CI's run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") == "true" or os.environ.get("HYPOTHESIS_PROFILE") == "ci":
    settings.load_profile("ci")

# every conversion in the suite lints the rewritten graph (off by default: ~15 % of a large pass)
os.environ.setdefault("MPCONVERT_CHECK", "1")
# the slow-half advice measures this CPU: CLI output must not depend on which CPU runs the suite
# (tests/test_device_advice.py turns it back on)
os.environ.setdefault("MPCONVERT_NO_DEVICE_ADVICE", "1")
# the device probe's per-machine cache goes to a folder of the test run's own, not the user's ~/.cache
os.environ.setdefault("MPCONVERT_CACHE_DIR", tempfile.mkdtemp(prefix="mpconvert-cache-"))


@pytest.fixture
def one_thread():
    """fp16 GEMMs on this CPU run an OpenMP region that stalls for milliseconds when a core is busy;
    tiny fp16 tests run far faster (and more predictably) on one intra-op thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

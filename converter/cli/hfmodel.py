"""A ``save_pretrained`` folder as a model: built with transformers' Auto classes, offline.

``mpconvert path/to/folder`` (a folder with ``config.json``) reads the config with
``AutoConfig.from_pretrained``, picks the Auto class whose mapping gives the class named in
``config.architectures`` (``AutoModelForCausalLM`` for ``GPT2LMHeadModel``, ``AutoModel`` for
``BertModel``, ...), and loads the weights with ``local_files_only=True``: nothing is downloaded.

The example inputs follow the model's ``main_input_name``:

* ``input_ids`` (text): ``(batch, seq_len)`` token ids below ``vocab_size``; ``seq_len`` is capped
  by the position table (``max_position_embeddings``/``n_positions``);
* ``pixel_values`` (vision): ``(batch, num_channels, image_size, image_size)``;
* ``input_values`` (audio waveforms): ``(batch, seq_len)`` samples (default 4000).

``--batch`` (default 2) and ``--seq-len`` (default 16 tokens, 4000 audio samples) set the sizes.
Decoders are loaded with ``use_cache=False`` (a key/value cache is not part of a training graph).
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from converter.cli.modelfile import ModelFile, ModelFileError

__all__ = ["PretrainedFolderError", "load_pretrained_folder", "example_inputs_for", "DEFAULT_BATCH", "DEFAULT_SEQ_LEN"]

DEFAULT_BATCH = 2
DEFAULT_SEQ_LEN = 16
DEFAULT_AUDIO_SAMPLES = 4000
_AUTO_CLASSES = (
    "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForImageClassification",
    "AutoModelForAudioClassification", "AutoModelForCTC", "AutoModelForPreTraining", "AutoModel",
)


class PretrainedFolderError(ModelFileError):
    """The folder cannot be built into a model; the message is one line naming the problem and the fix."""


def _read_config_json(folder: Path) -> dict:
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PretrainedFolderError(f"{folder / 'config.json'}: not a readable JSON config ({exc}); write it with save_pretrained") from None
    if not isinstance(data, dict):
        raise PretrainedFolderError(f"{folder / 'config.json'}: not a JSON object; write it with save_pretrained")
    return data


def _auto_class(transformers: Any, config: Any, architecture: Optional[str]):
    """The Auto class that maps ``type(config)`` to ``architecture`` (``AutoModel`` when none names it)."""
    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None or architecture is None:
            continue
        try:
            cls = mapping[type(config)]
        except (KeyError, ValueError):
            continue
        classes = cls if isinstance(cls, (tuple, list)) else (cls,)
        if any(getattr(c, "__name__", "") == architecture for c in classes):
            return auto
    return transformers.AutoModel


@contextlib.contextmanager
def _offline():
    """No network while loading: the hub client reads HF_HUB_OFFLINE."""
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


#: a checkpoint whose weight files take more than this share of the machine's memory is converted
#: without its weights (on the meta device) unless --load-weights says otherwise
_EMPTY_ABOVE = 0.25


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume the weights fit
        return 1 << 62


def without_weights(folder: Path, choice: Optional[bool] = None) -> tuple[bool, str]:
    """Whether to build ``folder``'s model on the meta device (``choice``: --empty-weights / --load-weights),
    and why: a folder with no weight files, or weights larger than a quarter of this machine's memory."""
    if choice is not None:
        return choice, "--empty-weights" if choice else "--load-weights"
    size = _weight_bytes(folder)
    if size == 0:
        return True, "the folder has no weight files (config only)"
    if size > _EMPTY_ABOVE * _memory_bytes():
        return True, f"its weights ({size / 2**30:.1f} GiB) exceed a quarter of this machine's memory"
    return False, ""


def _build(folder: Path, *, empty: bool = False):
    try:
        import transformers
    except ImportError:
        raise PretrainedFolderError(f"{folder} is a checkpoint folder, but transformers is not installed; pip install transformers") from None
    data = _read_config_json(folder)
    architectures = data.get("architectures") or [None]
    try:
        with _offline():
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
            if hasattr(config, "use_cache"):
                config.use_cache = False
            auto = _auto_class(transformers, config, architectures[0])
            if empty:  # parameters on meta, buffers real: model.py then loads the folder's weights
                from converter.ir.empty import empty_weights

                with empty_weights():
                    model = auto.from_config(config)
                return model.eval(), config, f"{auto.__name__}.from_config (without weights)"
            model = auto.from_pretrained(str(folder), config=config, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        text = " ".join(str(exc).split())[:300]
        raise PretrainedFolderError(f"{folder}: transformers cannot build a model from it ({type(exc).__name__}: {text}); "
                                    "check config.json and the weights file that save_pretrained wrote") from None
    return model.eval(), config, f"{auto.__name__}.from_pretrained"


def _config_int(config: Any, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
            return int(value[0])
    return None


def example_inputs_for(model: Any, config: Any, *, batch: Optional[int] = None, seq_len: Optional[int] = None) -> tuple[tuple, dict]:
    """``((), {main_input_name: tensor})`` sized from the config and ``batch``/``seq_len``."""
    import torch

    batch = batch or DEFAULT_BATCH
    gen = torch.Generator().manual_seed(0)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = _config_int(config, "vocab_size") or 2
        limit = _config_int(config, "max_position_embeddings", "n_positions", "n_ctx")
        length = seq_len or (min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN)
        if limit and length > limit:
            raise PretrainedFolderError(f"--seq-len {length} exceeds the model's {limit} positions; pass --seq-len {limit} or less")
        return (), {"input_ids": torch.randint(0, vocab, (batch, length), generator=gen)}
    if name == "pixel_values":
        size = _config_int(config, "image_size") or 224
        channels = _config_int(config, "num_channels") or 3
        return (), {"pixel_values": torch.randn(batch, channels, size, size, generator=gen)}
    if name == "input_values":
        return (), {"input_values": torch.randn(batch, seq_len or DEFAULT_AUDIO_SAMPLES, generator=gen)}
    raise PretrainedFolderError(f"{type(model).__name__} takes {name!r}, for which mpconvert makes no example inputs; "
                                "write a model file with build_model() and example_inputs() instead")


def load_pretrained_folder(folder: Path, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                           empty: Optional[bool] = None) -> ModelFile:
    """Build the model in ``folder`` (offline) and make its example inputs; see the module docstring.

    ``empty``: build it without its weights (True), with them (False), or decide (None, see
    :func:`without_weights`)."""
    folder = Path(folder)
    model, config, how = _build(folder, empty=without_weights(folder, empty)[0])
    inputs = example_inputs_for(model, config, batch=batch, seq_len=seq_len)
    return ModelFile(path=folder, module=None, model=model, entry=how, example_inputs=inputs)

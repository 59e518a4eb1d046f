"""A ``save_pretrained`` folder as a model: built with transformers' Auto classes, offline.

``mpconvert path/to/folder`` (a folder with ``config.json``) reads the config with
``AutoConfig.from_pretrained``, picks the Auto class whose mapping gives the class named in
``config.architectures`` (``AutoModelForCausalLM`` for ``GPT2LMHeadModel``, ``AutoModel`` for
``BertModel``, ...), and loads the weights with ``local_files_only=True``: nothing is downloaded.

The example inputs are the ones the model's forward takes (``inspect.signature(model.forward)``),
sized from the config, so that the converted model takes them too (a graph takes exactly the
inputs it was captured with):

* text: ``input_ids`` ``(batch, seq_len)`` below ``vocab_size`` (``seq_len`` capped by the position
  table, ``max_position_embeddings``/``n_positions``), with ``attention_mask`` where the forward
  takes it: the example is a *padded* batch (row 0 full, later rows end in pad tokens, mask 0), so
  the graph is the one padded batches need; ``token_type_ids`` (two segments) where the forward
  takes them and ``type_vocab_size > 1`` (BERT); encoder-decoders also get ``decoder_input_ids`` (half
  as long, starting with ``decoder_start_token_id``) and a padded ``decoder_attention_mask``;
* vision: ``pixel_values`` ``(batch, num_channels, image_size, image_size)``, with a padded
  ``pixel_mask`` where the forward takes one (DETR-like);
* audio: ``input_values`` ``(batch, seq_len)`` samples (default 4000), with a padded
  ``attention_mask`` where the forward takes it, unless the config's ``feat_extract_norm`` is
  ``group`` (wav2vec2-base-like models must not be given one).

Not made: ``labels`` (they would put the loss into the graph, and every call, inference included,
would then need labels; ``train.py`` takes its loss from a model file), ``position_ids`` (derived
inside the model; making it an input would make every caller compute it) and caches.

``--batch`` (default 2) and ``--seq-len`` (default 16 tokens, 4000 audio samples) set the sizes.
Decoders are loaded with ``use_cache=False`` (a key/value cache is not part of a training graph);
:func:`load_pretrained_folder` records that, and the inputs made, in ``ModelFile.source``, which the
CLI writes into report.json (``source``) and model.py's docstring.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import stat
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


def _remote_code(folder: Path, data: dict) -> list[str]:
    """The folder's own Python files that building it would run (config.json's ``auto_map``), [] if none."""
    auto_map = data.get("auto_map")
    if not auto_map:
        return []
    refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    modules = set()
    for ref in refs:
        for item in (ref if isinstance(ref, (list, tuple)) else [ref]):
            if isinstance(item, str) and "." in item:
                modules.add(item.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return sorted(modules) or sorted(p.name for p in folder.glob("*.py")) or ["auto_map in config.json"]


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, opened without blocking (open() of a FIFO waits for a writer forever);
    :class:`PretrainedFolderError` unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise PretrainedFolderError(f"{path}: not a readable weight index ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PretrainedFolderError(f"{path} is not a regular file (a FIFO, device or socket); a weight index must "
                                        "be a plain file: write the folder again with save_pretrained (nothing was read)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _check_index_paths(folder: Path) -> None:
    """Every file a weight index names lies inside ``folder`` (checked before any library opens one):
    transformers follows ``../`` in ``model.safetensors.index.json``."""
    for index in sorted(folder.glob("*.index.json")):
        raw = _read_regular(index)
        try:
            weight_map = json.loads(raw.decode("utf-8-sig")).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise PretrainedFolderError(f"{index}: not a readable weight index ({exc}); write it with save_pretrained") from None
        if not isinstance(weight_map, dict):
            raise PretrainedFolderError(f"{index}: has no weight_map object; write it with save_pretrained")
        root = os.path.normpath(os.path.abspath(folder))
        for name in dict.fromkeys(weight_map.values()):
            where = os.path.normpath(os.path.join(root, str(name)))
            if not isinstance(name, str) or os.path.isabs(name) or os.path.commonpath([root, where]) != root:
                raise PretrainedFolderError(f"{index} names {name!r}, which is outside {folder}; a weight index may "
                                            "only name files inside its own folder (nothing was read)")


def _weights_error(folder: Path, exc: BaseException) -> Optional[str]:
    """One line for a weight file that cannot be read safely (None: not such an error)."""
    text = " ".join(str(exc).split())
    if type(exc).__name__ == "UnpicklingError" or "weights_only" in text:
        return (f"{folder}: a .bin/.pt weight file holds pickled objects other than tensors, so torch's weights-only loader refused it "
                "(nothing in it ran); convert it to safetensors where you trust its origin, or pass a folder with "
                "model.safetensors")
    if type(exc).__name__ == "SafetensorError" or "safetensors" in type(exc).__module__:
        return (f"{folder}: a safetensors weight file is damaged ({text[:160]}); write the checkpoint again with "
                "save_pretrained, or check that the copy is complete")
    return None


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_loaded(folder: Path, info: dict, allow_missing: bool) -> dict:
    """What transformers' loading report says about the checkpoint's tensors: a tensor the model needs that the
    checkpoint lacks is refused in one line (transformers initialises it randomly and only logs it), unless
    ``allow_missing`` (--allow-missing-weights); returns ``{"initialised_randomly": [...], "unused": [...]}``."""
    missing = sorted(str(name) for name in info.get("missing_keys") or ())
    unused = sorted(str(name) for name in info.get("unexpected_keys") or ())
    if missing and not allow_missing:
        raise PretrainedFolderError(
            f"{folder}: the checkpoint lacks {len(missing)} tensor(s) the model needs ({_names(missing)}), which would be "
            "initialised randomly; write the checkpoint again with save_pretrained (or check that the copy is complete), "
            "or pass --allow-missing-weights to convert with them randomly initialised")
    return {"initialised_randomly": missing, "unused": unused}


def _build(folder: Path, *, empty: bool = False, trust_remote_code: bool = False, allow_missing: bool = False):
    try:
        import transformers
    except ImportError:
        raise PretrainedFolderError(f"{folder} is a checkpoint folder, but transformers is not installed; pip install transformers") from None
    data = _read_config_json(folder)
    code = _remote_code(folder, data)
    if code and not trust_remote_code:
        raise PretrainedFolderError(
            f"{folder} builds its model with its own Python code ({', '.join(code[:4])}, named by config.json's auto_map); "
            "mpconvert runs no code from a checkpoint folder unless you pass --trust-remote-code (read that code first)")
    _check_index_paths(folder)
    architectures = data.get("architectures") or [None]
    try:
        with _offline():
            # trust_remote_code is passed explicitly: left unset, transformers asks on stdin, which the CLI hides
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                             trust_remote_code=trust_remote_code)
            if hasattr(config, "use_cache"):
                config.use_cache = False
            auto = _auto_class(transformers, config, architectures[0])
            if empty:  # parameters on meta, buffers real: model.py then loads the folder's weights
                from converter.ir.empty import empty_weights

                with empty_weights():
                    model = auto.from_config(config, trust_remote_code=trust_remote_code)
                return model.eval(), config, f"{auto.__name__}.from_config (without weights)", {}
            model, info = auto.from_pretrained(str(folder), config=config, local_files_only=True,
                                               trust_remote_code=trust_remote_code, output_loading_info=True)
    except Exception as exc:  # the checkpoint is the user's input: classify what transformers raised
        unsafe = _weights_error(folder, exc)
        if unsafe is not None:
            raise PretrainedFolderError(unsafe) from None
        if not isinstance(exc, (OSError, ValueError, KeyError, TypeError, ImportError)):
            raise
        text = " ".join(str(exc).split())[:300]
        raise PretrainedFolderError(f"{folder}: transformers cannot build a model from it ({type(exc).__name__}: {text}); "
                                    "check config.json and the weights file that save_pretrained wrote") from None
    return model.eval(), config, f"{auto.__name__}.from_pretrained", _check_loaded(folder, info, allow_missing)


def _config_int(config: Any, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
            return int(value[0])
    return None


def _forward_params(model: Any) -> set[str]:
    """The named parameters of ``model.forward`` (``**kwargs`` does not count: only what it names)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _padded_mask(batch: int, length: int, *, pad_from: int = 0):
    """``(batch, length)`` int64 ones, rows ``r >= 1`` ending in ``r * length // (2 * batch)`` zeros
    (at least one zero where ``length`` allows): a right-padded batch whose rows all keep real tokens."""
    import torch

    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        pad = min(max(1, row * length // (2 * batch)), length - 1 - pad_from) if length > 1 + pad_from else 0
        if pad > 0:
            mask[row, length - pad:] = 0
    return mask


def _token_id(config: Any, name: str, vocab: int, default: int = 0) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab else default


def _text_length(config: Any, seq_len: Optional[int]) -> int:
    limit = _config_int(config, "max_position_embeddings", "n_positions", "n_ctx")
    length = seq_len or (min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN)
    if limit and length > limit:
        raise PretrainedFolderError(f"--seq-len {length} exceeds the model's {limit} positions; pass --seq-len {limit} or less")
    return length


def _text_inputs(config: Any, params: set[str], batch: int, seq_len: Optional[int], gen) -> dict:
    import torch

    vocab = _config_int(config, "vocab_size") or 2
    length = _text_length(config, seq_len)
    pad = _token_id(config, "pad_token_id", vocab)
    mask = _padded_mask(batch, length)
    ids = torch.randint(0, vocab, (batch, length), generator=gen).masked_fill(mask == 0, pad)
    out = {"input_ids": ids}
    if "attention_mask" in params:
        out["attention_mask"] = mask
    types = _config_int(config, "type_vocab_size")
    if "token_type_ids" in params and types and types > 1:  # two segments, as a tokenizer gives a pair
        real = mask.sum(dim=1, keepdim=True)
        position = torch.arange(length).unsqueeze(0)
        out["token_type_ids"] = ((position >= (real + 1) // 2) & (mask == 1)).long()
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        # half as long (a dim of its own), the target side of a padded batch
        dec_len = max(2, length // 2) if length >= 2 else length
        dec_mask = _padded_mask(batch, dec_len, pad_from=1)
        dec = torch.randint(0, vocab, (batch, dec_len), generator=gen).masked_fill(dec_mask == 0, pad)
        dec[:, 0] = _token_id(config, "decoder_start_token_id", vocab, pad)
        out["decoder_input_ids"] = dec
        if "decoder_attention_mask" in params:
            out["decoder_attention_mask"] = dec_mask
    return out


def example_inputs_for(model: Any, config: Any, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                       seed: int = 0) -> tuple[tuple, dict]:
    """``((), {name: tensor, ...})``: the inputs ``model.forward`` takes (see the module docstring),
    sized from the config and ``batch``/``seq_len``; ``seed`` draws another batch of the same form."""
    import torch

    batch = batch or DEFAULT_BATCH
    gen = torch.Generator().manual_seed(seed)
    name = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model) | {name}
    if name == "input_ids":
        return (), _text_inputs(config, params, batch, seq_len, gen)
    if name == "pixel_values":
        size = _config_int(config, "image_size") or 224
        channels = _config_int(config, "num_channels") or 3
        out = {"pixel_values": torch.randn(batch, channels, size, size, generator=gen)}
        if "pixel_mask" in params:  # padded images: the right-hand columns of later rows are padding
            mask = _padded_mask(batch, size).unsqueeze(1).expand(batch, size, size).contiguous()
            out["pixel_values"] = out["pixel_values"] * mask.unsqueeze(1)
            out["pixel_mask"] = mask
        return (), out
    if name == "input_values":
        samples = seq_len or DEFAULT_AUDIO_SAMPLES
        values = torch.randn(batch, samples, generator=gen)
        if "attention_mask" in params and getattr(config, "feat_extract_norm", None) != "group":
            mask = _padded_mask(batch, samples)
            return (), {"input_values": values * mask, "attention_mask": mask}
        return (), {"input_values": values}
    raise PretrainedFolderError(f"{type(model).__name__} takes {name!r}, for which mpconvert makes no example inputs; "
                                "write a model file with build_model() and example_inputs() instead")


def _source(folder: Path, model: Any, how: str, inputs: tuple[tuple, dict], data: dict, loaded: dict) -> dict:
    """What the CLI records about the folder in report.json (``source``) and model.py's docstring."""
    kwargs = inputs[1]
    shapes = {name: list(t.shape) for name, t in kwargs.items()}
    padded = [name for name, t in kwargs.items() if name.endswith("mask") and bool((t == 0).any())]
    cache = getattr(getattr(model, "config", None), "use_cache", None)
    folder_cache = data.get("use_cache")
    note = (f"Built from the save_pretrained folder {folder.name} ({how}); its forward takes {', '.join(shapes)}"
            + (f" (the example was a padded batch: {', '.join(padded)} had zeros)." if padded else "."))
    if cache is False:
        said = f"config.json: use_cache={str(folder_cache).lower()}" if folder_cache is not None else "config.json sets no use_cache"
        note += (f" Loaded with use_cache=False ({said}): the graph computes and returns "
                 "no key/value cache; generate() with a cache needs the original model.")
    if loaded.get("initialised_randomly"):
        note += (f" {len(loaded['initialised_randomly'])} tensor(s) the checkpoint lacks were initialised randomly "
                 f"(--allow-missing-weights): {', '.join(loaded['initialised_randomly'])}.")
    return {"kind": "save_pretrained folder", "folder": str(folder), "built_with": how, "inputs": shapes,
            "padded": padded, "use_cache": cache, "config_use_cache": folder_cache, "note": note, **loaded}


def load_pretrained_folder(folder: Path, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                           empty: Optional[bool] = None, trust_remote_code: bool = False,
                           allow_missing_weights: bool = False) -> ModelFile:
    """Build the model in ``folder`` (offline) and make its example inputs; see the module docstring.

    ``empty``: build it without its weights (True), with them (False), or decide (None, see
    :func:`without_weights`). ``trust_remote_code``: allow the folder's own Python code (config.json's
    ``auto_map``) to run; without it such a folder is refused in one line naming the files. ``ModelFile.make_inputs(seed)`` draws more batches of the example's
    form (``--calibration-data synthetic``). ``allow_missing_weights``: a tensor the model needs that the
    checkpoint lacks is initialised randomly (named in ``source["initialised_randomly"]``) instead of refused."""
    folder = Path(folder)
    model, config, how, loaded = _build(folder, empty=without_weights(folder, empty)[0], trust_remote_code=trust_remote_code,
                                        allow_missing=allow_missing_weights)
    inputs = example_inputs_for(model, config, batch=batch, seq_len=seq_len)

    def make_inputs(seed: int) -> tuple[tuple, dict]:
        return example_inputs_for(model, config, batch=batch, seq_len=seq_len, seed=seed)

    return ModelFile(path=folder, module=None, model=model, entry=how, example_inputs=inputs,
                     source=_source(folder, model, how, inputs, _read_config_json(folder), loaded), make_inputs=make_inputs)

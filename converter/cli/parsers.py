"""The ``mpconvert`` command lines: one argparse parser per command, each with only the flags that command
honours, and :func:`parse`, which turns an argv into the command, its namespace and any deprecation notes.

Flags per command (docs/cli.md): ``mpconvert MODEL`` (convert) takes them all; ``audit`` writes only the
reports, so it takes no weight, calibration, ONNX or measuring flag; ``explain`` writes nothing, so it also
takes no ``--out``/``--force``/``--strict-modes``/``--device-profile``; ``rules check`` takes the files and
``-q/--json/--debug``; ``profile`` takes ``-o FILE`` and those.
A flag a command does not take is one line of bad input (exit 2) naming the command that takes it.

Imports no torch: ``explain OUT_DIR`` and ``--help`` answer without it.
"""
from __future__ import annotations

import argparse
from typing import NamedTuple, Optional

from converter.ir.errors import MpconvertError
from converter.vocab import DEVICES, HALF_PRECISIONS, OPT_LEVELS, TRACERS, PrecisionError, describe, precision

__all__ = ["UsageError", "Parser", "Parsed", "build_parsers", "parse", "split_command", "legacy_rules", "refuse_nul", "tune_for",
           "PRECISION_HELP"]

PRECISION_HELP = (f"{describe()}; fp8 is bf16 with the GEMMs the rules mark fp8 running in float8 (docs/fp8.md); "
                  "default bf16")

_EPILOG = """\
commands:
  mpconvert MODEL [options]             convert; writes MODEL_mp/ (model.py, model.safetensors, train.py, reports)
  mpconvert audit MODEL [options]       the report only; writes MODEL_audit/ (report.json, .md, .html)
  mpconvert explain OUT_DIR|MODEL NODE  every rule that matched NODE, its precedence, and the winner
  mpconvert rules check FILE...         validate rule files (exit 2 on the first problem of each file)
  mpconvert profile -o FILE             measure this machine's device profile and save it (--device-profile FILE)

MODEL is a model file defining build_model() (or a module-level `model`) and example_inputs(), and
optionally calibration_inputs() for --calibrate, loss_fn(output, batch) + train_batches() for
train.py (docs/model-file.md); or a save_pretrained folder with config.json (built offline with
transformers' Auto classes; its example inputs are the ones its forward takes, made from the config:
input_ids with a padded attention_mask, token_type_ids, decoder_input_ids, pixel_values, ...; --batch
and --seq-len size them; --calibrate on it needs --calibration-data FILE). Full contract: docs/cli.md.

examples:
  mpconvert samples/mlp.py                          bf16 conversion into ./mlp_mp/
  mpconvert samples/tiny_transformer.py --precision fp16 --rules llm --out tt_fp16 --force
  mpconvert --rules llm --rules my.toml samples/mlp.py   one file per --rules; repeat it
  mpconvert samples/tiny_transformer.py --device cpu     the model will train on the CPU: its lowerings
  mpconvert path/to/checkpoint --batch 4 --seq-len 128   a save_pretrained folder, offline
  mpconvert path/to/checkpoint --precision fp16 --calibration-data calib.safetensors   calibrated on your batches
  mpconvert samples/hf_gpt2.py --onnx               also write and verify model.onnx
  mpconvert samples/mlp.py --calibrate --tolerance 30   re-decide overflow-prone nodes; keep SQNR >= 30 dB
  mpconvert audit samples/cnn.py --json             machine-readable summary on stdout
  mpconvert explain cnn_audit b1_conv                instant: reads cnn_audit/report.json
  mpconvert explain samples/tiny_transformer.py layers_0_attn_qkv
  mpconvert rules check rules/llm.toml my_rules.toml
  mpconvert profile -o cpu.json && mpconvert samples/mlp.py --device-profile cpu.json   the same kernels on every run
  python mlp_mp/train.py --steps 5                  train the emitted model

exit status: 0 ok, 1 a requested check failed, 2 bad input (one line on stderr; --debug for the
traceback; nothing written), 3 internal error.
"""


class UsageError(MpconvertError, ValueError):
    """Bad command-line usage; the message is one line."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised, not printed) so that main() controls the output."""

    def error(self, message: str):  # noqa: D102
        raise UsageError(f"{message}; see `{self.prog} --help`")


class Parsed(NamedTuple):
    """A parsed command line: the command, its namespace (read by that command only) and deprecation notes."""

    command: str
    namespace: argparse.Namespace
    notes: list[str]


def _common(p: argparse.ArgumentParser, *, json_help: str = "print a JSON summary on stdout instead of text") -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or tables; print only the output path")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _model_options(p: argparse.ArgumentParser, command: str) -> None:
    """The flags that say what to convert and how: every command that builds or audits a model."""
    p.add_argument("--precision", default="bf16", metavar="P", help=PRECISION_HELP)
    p.add_argument("--rules", action="append", default=None, metavar="F",
                   help="a rule file layered over the defaults; repeat the flag for more (--rules a --rules b), later wins. "
                        "A bare name such as `llm` is a built-in file")
    p.add_argument("--tracer", choices=TRACERS, default="auto",
                   help="auto tries torch.fx then torch.export (default auto)")
    p.add_argument("--entry", metavar="NAME", default=None, help="the model factory (or module-level model) to use instead of build_model/model")
    _folder_options(p)
    p.add_argument("--opt-level", dest="opt_level", choices=OPT_LEVELS, default="O1",
                   help="how parameters will be stored for training: O1 fp32 (weight casts count in placement), "
                        "O2 half where every consumer is half, with fp32 master weights in the trainer (default O1)")
    if command == "convert":
        p.add_argument("--max-shard-size", dest="max_shard_size", type=_shard_size, default=None, metavar="SIZE",
                       help="split the safetensors weights into files of at most SIZE bytes (500MB, 2GiB, or a number) "
                            "listed in model.safetensors.index.json (default 2GiB)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="the device the model will train on. It enables that device's lowerings (cpu: bf16 attention as "
                        "matmul/softmax/matmul, 2-4x faster than the CPU flash kernel), and model.py is also checked there "
                        "when it is available. Default: a portable graph, checked on cpu")
    p.add_argument("--tune-for", dest="tune_for", choices=DEVICES, default=None, help=argparse.SUPPRESS)
    if command == "convert":
        p.add_argument("--no-measure", dest="no_measure", action="store_true",
                       help="skip measuring memory and numerics against fp32 and torch.autocast for the report")
    if command in ("convert", "audit"):
        p.add_argument("--device-profile", dest="device_profile", default=None, metavar="PATH|auto|none",
                       help="the device figures (matmul timings per dtype) that the device-dependent kernel choices and the "
                            "slow-half advice read, recorded in report.json: auto measures this machine in this run "
                            "(default), PATH reads a file `mpconvert profile -o FILE` wrote (the same choices wherever "
                            "it runs), none measures nothing (fixed choices: native half GEMMs, no advice)")
        p.add_argument("--no-breaks", dest="no_breaks", action="store_true",
                       help="refuse (exit 2) a model that no tracer captures whole, instead of converting it region by "
                            "region with its graph breaks reported (default: the code between converted regions runs "
                            "eagerly under torch.autocast); for users who need one graph (ONNX)")
        p.add_argument("--strict-modes", dest="strict_modes", action="store_true",
                       help="refuse (exit 2) a model whose train mode cannot be traced, instead of converting it frozen in "
                            "one mode where train()/eval() change nothing (default: converted, with a warning)")
    p.add_argument("--static", action="store_true",
                   help="fix every input dim to the example's size (default: batch, sequence and other input dims "
                        "stay dynamic under torch.export, or as the model file's dynamic_shapes() says)")


def _folder_options(p: argparse.ArgumentParser) -> None:
    """The flags that only a save_pretrained folder reads."""
    p.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                   help="checkpoint folders only: the batch size of the example inputs made from config.json (default 2)")
    p.add_argument("--seq-len", dest="seq_len", type=_positive_int, default=None, metavar="T",
                   help="checkpoint folders only: the sequence length of text inputs (default 16; audio: samples)")
    p.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                   help="checkpoint folders only: allow a folder's own Python code (config.json's auto_map) to run while "
                        "building the model; without it such a folder is refused. Read that code first")
    p.add_argument("--allow-missing-weights", dest="allow_missing_weights", action="store_true",
                   help="checkpoint folders only: convert even when the checkpoint lacks tensors the model needs, "
                        "initialising them randomly with a warning naming each one; without it such a folder is refused")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--empty-weights", dest="empty_weights", action="store_const", const=True, default=None,
                         help="checkpoint folders only: build the model without its weights (parameters on the meta device); "
                              "model.py then loads them with load(weights=FOLDER). Default when the folder has no weight "
                              "files or they exceed a quarter of this machine's memory")
    weights.add_argument("--load-weights", dest="empty_weights", action="store_const", const=False,
                         help="checkpoint folders only: load the weights even when they are large (model.py is then checked "
                              "bit-exactly and the report measured)")


def _shard_size(text: str) -> int:
    from converter.export.weights import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 500MB, 2GiB or a number of bytes") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1 or value > 1_000_000:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 1 and 1000000")
    return value


def _precision_arg(value: str) -> str:
    """argparse ``type=``: the canonical half precision, or the shared one-line message."""
    try:
        return precision(value, allowed=HALF_PRECISIONS)
    except PrecisionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rules_check_parser() -> Parser:
    rules = Parser(prog="mpconvert rules check", description="Validate rule files: TOML syntax, tables, keys, precisions and op names.")
    rules.add_argument("files", nargs="+", metavar="FILE")
    _common(rules)
    return rules


def _convert_parser() -> Parser:
    from converter._version import __version__

    convert = Parser(
        prog="mpconvert",
        description="Convert a PyTorch model to mixed precision with rules you can read, and write a standalone "
        "rewritten model, its weights, a training script and an audit report.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("model", metavar="MODEL",
                         help="the model file (docs/model-file.md), or a folder written by save_pretrained (with config.json)")
    _model_options(convert, "convert")
    convert.add_argument("--out", metavar="DIR", default=None, help="output directory (default ./MODEL_mp)")
    convert.add_argument("--calibrate", action="store_true",
                         help="run calibration_inputs() (or --calibration-data) and re-decide nodes that would overflow")
    convert.add_argument("--calibration-data", dest="calibration_data", metavar="FILE", default=None,
                         help="calibration batches (implies --calibrate): a .py file defining calibration_inputs() (docs/model-file.md; "
                              "it is imported, so its code runs; a .py inside a checkpoint folder needs --trust-remote-code), "
                              "a .safetensors file of tensors named INPUT or I.INPUT (batch I), or `synthetic` (checkpoint folders: "
                              "random padded batches made from config.json). Needed for --calibrate on a checkpoint folder; "
                              "replaces a model file's calibration_inputs(). At most 256 batches are read; NaN/inf, empty batches, "
                              "token ids past the vocabulary and a batch the model cannot run are errors (exit 2)")
    convert.add_argument("--tolerance", metavar="DB", default=None,
                         help="with calibration: minimum SQNR in dB against fp32 (implies --calibrate); exit 1 if not met")
    convert.add_argument("--onnx", action="store_true", help="also export model.onnx and verify its casts and outputs")
    convert.add_argument("--onnx-precision", type=_precision_arg, default=None, metavar="P",
                         help="precision of model.onnx (default: the conversion's; bf16 exports fp16, since ONNX Runtime's CPU provider lacks bf16)")
    convert.add_argument("--force", action="store_true", help="replace an existing output directory")
    convert.add_argument("--version", action="version", version=f"mpconvert {__version__}")
    _common(convert)
    return convert


def _audit_parser() -> Parser:
    audit = Parser(prog="mpconvert audit", description="Report what each node would run in and why, and the casts a conversion would insert, "
                   "without writing the model. "
                   "Writes report.json, report.md and report.html.")
    audit.add_argument("model", metavar="MODEL", help="the model file, or a save_pretrained folder")
    _model_options(audit, "audit")
    audit.add_argument("--out", metavar="DIR", default=None, help="report directory (default ./MODEL_audit)")
    audit.add_argument("--force", action="store_true", help="replace an existing report directory")
    _common(audit)
    return audit


def _explain_parser() -> Parser:
    explain = Parser(prog="mpconvert explain", description="Show the decision chain of one node: every rule that matched, "
                     "its precedence level, the winner and why.")
    explain.add_argument("model", metavar="MODEL.py|OUT_DIR",
                         help="an output directory of convert or audit (read its report.json: instant), or a model file "
                              "(its fresh MODEL_mp/ or MODEL_audit/ report is reused; else it is audited)")
    explain.add_argument("node", metavar="NODE", help="a node name as listed by `mpconvert audit` (report.md, report.json)")
    _model_options(explain, "explain")
    _common(explain)
    return explain


def _profile_parser() -> Parser:
    profile = Parser(prog="mpconvert profile", description="Measure this machine's device profile (one small matmul timed "
                     "per dtype on the CPU, the CUDA device's capability) and save it as JSON, for --device-profile FILE.")
    profile.add_argument("-o", "--output", dest="output", metavar="FILE", required=True,
                         help="the JSON file to write (replaced if it exists)")
    _common(profile, json_help="print the profile as JSON on stdout instead of text")
    return profile


_BUILDERS = {"convert": _convert_parser, "audit": _audit_parser, "explain": _explain_parser, "rules check": _rules_check_parser,
             "profile": _profile_parser}


def build_parsers(only: Optional[str] = None) -> dict[str, argparse.ArgumentParser]:
    """The parsers of every command (or just ``only``), keyed by command name (``convert``,
    ``audit``, ``explain``, ``rules check``)."""
    names = [only] if only is not None else list(_BUILDERS)
    return {name: _BUILDERS[name]() for name in names}


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """The command an argv names, and the rest of it."""
    if not argv:
        raise UsageError("missing MODEL.py: usage: mpconvert MODEL.py [options], or mpconvert audit|explain|rules check ...; see `mpconvert --help`")
    head = argv[0]
    if head in ("audit", "explain", "profile"):
        return head, argv[1:]
    if head == "rules":
        if len(argv) < 2 or argv[1] != "check":
            raise UsageError("unknown rules command; use `mpconvert rules check FILE...`")
        return "rules check", argv[2:]
    return "convert", argv


_POSITIONALS = {"convert": 1, "audit": 1, "explain": 2, "rules check": None, "profile": None}


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser`` that take a value (``--out DIR``), as opposed to flags."""
    return {opt for action in parser._actions if action.nargs != 0 for opt in action.option_strings}


def legacy_rules(argv: list[str], parser: argparse.ArgumentParser, command: str) -> tuple[list[str], list[str]]:
    """Rewrite the old ``--rules A B`` spelling (several files after one flag) to ``--rules A --rules B``.

    Only positional words beyond what the command takes, right after a ``--rules`` value, are read
    as more rule files, so ``mpconvert --rules llm MODEL.py`` keeps MODEL.py as the model. Returns
    the rewritten argv and the deprecation messages.
    """
    wanted = _POSITIONALS.get(command)
    if wanted is None or "--rules" not in argv:
        return argv, []
    takes_value = _value_options(parser)
    positions: list[int] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            positions.extend(range(i + 1, len(argv)))
            break
        if token.startswith("-") and token != "-":
            i += 2 if token in takes_value else 1
            continue
        positions.append(i)
        i += 1
    surplus = len(positions) - wanted
    extra: set[int] = set()
    for i, token in enumerate(argv[:-1]):
        if token != "--rules" or surplus <= 0:
            continue
        j = i + 2
        while surplus > 0 and j in positions:
            extra.add(j)
            surplus -= 1
            j += 1
    if not extra:
        return argv, []
    out: list[str] = []
    for i, token in enumerate(argv):
        out.extend(["--rules", token] if i in extra else [token])
    moved = " ".join(argv[i] for i in sorted(extra))
    return out, [f"`--rules F1 F2 ...` is deprecated (read {moved} as rule files); repeat the flag instead: --rules F1 --rules F2"]


def parse(argv: list[str]) -> Parsed:
    """The command of ``argv`` and its namespace, with ``--rules A B`` read as ``--rules A --rules B`` (the notes say so).

    ``--help``/``--version`` raise ``SystemExit`` as argparse does; every problem is a :class:`UsageError`."""
    command, rest = split_command(argv)
    parser = build_parsers(command)[command]
    rest, notes = legacy_rules(rest, parser, command)
    ns, extra = parser.parse_known_args(rest)
    if extra:
        parser.error(_unrecognized(extra, command))
    return Parsed(command, ns, notes)


def _unrecognized(extra: list[str], command: str) -> str:
    """argparse's message for flags a command does not take, naming the command that does take one."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    flags = [token.split("=", 1)[0] for token in extra if token.startswith("--")]
    for name, builder in _BUILDERS.items():
        if name == command:
            continue
        known = {opt for action in builder()._actions for opt in action.option_strings}
        taken = [flag for flag in flags if flag in known]
        if taken:
            owner = "mpconvert MODEL" if name == "convert" else f"mpconvert {name}"
            return f"{message} ({taken[0]} is an option of `{owner}`, which `mpconvert {command}` does not use)"
    return message


def refuse_nul(values: dict) -> None:
    """No file system or Python name accepts a NUL byte: refuse it in any argument, naming the option."""
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and "\x00" in v for v in items):
            what = {"model": "the model path", "node": "the node name", "files": "a rules file name"}.get(key, f"--{key.replace('_', '-')}")
            raise UsageError(f"{what} contains a NUL byte; remove it")


def tune_for(tune_for: str, device: Optional[str]) -> tuple[str, str]:
    """The deprecated ``--tune-for D`` is ``--device D``: the device, and the deprecation message."""
    if device is not None and device != tune_for:
        raise UsageError(f"--tune-for {tune_for} contradicts --device {device}; drop --tune-for (it is now --device)")
    return tune_for, f"--tune-for is deprecated; use --device {tune_for} (the device the model will train on)"

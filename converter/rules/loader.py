"""Rule files: plain TOML data that marks ops FP16, BF16, FP32, ``follow``, ``promote`` or ``banned``.

A rule file has up to four match tables, an optional ``[default]`` and optional ``[settings]``::

    [meta]
    description = "what this file is for"

    [op]                       # canonical op name (globs allowed): linear, softmax, conv*, ...
    linear = "half"
    softmax = { precision = "fp32", reason = "exp overflows in half" }
    binary_cross_entropy = { precision = "banned", message = "use binary_cross_entropy_with_logits" }

    [module_type]              # the class name of an enclosing module
    RMSNorm = "fp32"

    [module]                   # dotted module path, glob with fullmatch semantics
    "lm_head" = "fp32"
    "*.attn" = { precision = "half", ops = { softmax = "fp32" } }   # per-op overrides in a scope

    [node]                     # FX node name
    "linear_3" = "fp32"

    [default]
    precision = "fp32"         # what a node no rule matches gets (it is also listed as unmatched)

    [settings]
    overflow_fallback = "bf16" # what calibration re-decides an fp16-overflowing node to
    fp32_math = "ieee"         # the math of fp32 matmul/conv nodes: ieee | tf32 | inherit

Precision values: ``half`` (the target of the conversion, fp16 or bf16), ``fp16``, ``bf16``,
``fp32`` (IEEE fp32 math unless ``fp32_math`` says otherwise), ``tf32`` (fp32 storage; a
matmul/conv may use the backend's reduced fp32 math: TF32 on CUDA, bf16 in oneDNN on CPU),
``follow`` (the precision of its inputs, chosen by placement), ``promote`` (the widest floating
input) and ``banned`` (an error carrying ``message``). See :mod:`converter.passes.fp32_math`.

``fp8`` (:data:`GEMM_PRECISIONS`) is a compute mode for the GEMMs the fp8 kernels run (:data:`FP8_OPS`:
``linear`` and the op alias ``weight_matmul``, a matmul/mm/addmm of an activation and a 2-D weight parameter,
:mod:`converter.ir.weight_gemm`): their three GEMMs go through ``torch._scaled_mm``, their storage and IO stay bf16
(:mod:`converter.passes.fp8`). An ``[op]`` rule, an ``ops`` entry or a ``node`` rule that marks another op
``fp8`` is an error (here for op patterns, at decide time for node rules); a ``module``/``module_type`` rule
``fp8`` reaches only the GEMMs of its scope, the other ops of the scope fall through to the next rule.
The fp8 shape gates are ``[settings]``: ``fp8_recipe``, ``fp8_align``, ``fp8_min_flops_per_token``,
``fp8_keep_first``, ``fp8_keep_last`` (``rules/fp8.toml``); so are the SQNR floors of the fp8 fallback with
calibration, ``fp8_min_sqnr_output``, ``fp8_min_sqnr_grad_input``, ``fp8_min_sqnr_grad_weight`` (dB).

**Precedence**, highest first: ``node`` > ``module`` (path) > ``module_type`` > ``op`` > ``default``.
A module rule may carry an ``ops`` table: per-op precisions for ops inside that module's scope;
they outrank the module rule's own precision at the same module (not an inner module's rules).
A ``banned`` rule is the exception: it is an error whenever it matches, whatever else matches,
unless a ``node`` rule names that very node (an explicit, reviewed exemption).
A module rule applies to every op inside that module's scope; when several modules of a node's
stack match at the same level, the innermost module wins. **Scope**: ``scope = "subtree"`` (the
default) reaches the ops of the module and of all its child modules; ``scope = "self"`` only the
ops the module runs itself, not those of its children. A rule whose pattern names a norm
(``norm`` anywhere in it, any case: ``*LayerNorm``, ``*RMSNorm``, ``*.norm1``) defaults to ``"self"``,
so a norm rule never pins the linears of a block that contains it, nor of a block whose class name
merely ends in ``LayerNorm`` (HF's ``...EncoderLayerStableLayerNorm``). The scope is data: the
``scope`` key, else the pattern; a rule's ``reason`` is prose and never changes what it does (a
norm rule named by its instance, ``ln_f``, says ``scope = "self"``)::

    [module_type]
    "*LayerNorm" = { precision = "fp32", scope = "self" } Between two rules of the same level and
scope, the one read last wins, so a later file overrides an earlier one (layering).

**Op aliases**: a node may carry a second op name (``NodeInfo.op_alias``: ``weight_matmul`` for a
matmul/mm/addmm of an activation and a 2-D weight parameter). Op patterns and ``ops`` entries match
the alias as well as the op; between two such rules of the same level the later file still wins, and
within one file the rule that names the alias wins (``rules/fp8.toml``: ``weight_matmul = "fp8"`` over
``matmul = "bf16"``). No rule naming an alias, no change: default.toml names none.

Patterns use :func:`fnmatch.fnmatchcase` against the *whole* name (``*.embed`` matches
``model.embed`` but never ``model.embedding_layer``).
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Optional, Sequence, Union, cast

import tomllib

from converter.ir.errors import MpconvertError
from converter.ir.meta import BUILTIN, Match, RequestedPrecision, RuleRef, RuleTable
from converter.ir.ops import WEIGHT_MATMUL, known_op_names
from converter.rules.precedence import MATCH_TABLES
from converter.rules.precedence import rank as level_rank
from converter.vocab import FP8_RECIPES, FP32_MATHS, GEMM_PRECISIONS, RULE_PRECISIONS

__all__ = [
    "Rule",
    "Rules",
    "RulesError",
    "PRECISIONS",
    "GEMM_PRECISIONS",
    "RULE_PRECISIONS",
    "FP8_OPS",
    "FP8_RECIPES",
    "LEVELS",
    "SCOPES",
    "default_scope",
    "load_rules",
    "default_rules_path",
    "rules_dir",
    "resolve_rules",
]

#: every precision a rule may name is RULE_PRECISIONS (:mod:`converter.vocab`); GEMM_PRECISIONS only a GEMM may
#: take (module docstring); PRECISIONS are the others
PRECISIONS = tuple(p for p in RULE_PRECISIONS if p not in GEMM_PRECISIONS)
#: the canonical ops an ``fp8`` rule may mark: those ``converter.fp8.kernels`` runs (``fp8_linear``)
FP8_OPS = frozenset({"linear", WEIGHT_MATMUL})
# FP8_RECIPES: the fp8 recipes (``converter.fp8.kernels.RECIPES``; from the vocabulary, the loader imports no kernels)
#: match tables, highest precedence first (see :mod:`converter.rules.precedence`)
LEVELS = MATCH_TABLES
_TOP_KEYS = ("meta", "settings", "default") + LEVELS
_RULE_KEYS = ("precision", "reason", "message")
_MODULE_RULE_KEYS = _RULE_KEYS + ("ops", "scope")
SCOPES = ("self", "subtree")
_NORM = re.compile("norm", re.IGNORECASE)
_SETTINGS = {
    "overflow_fallback": ("bf16", "fp32"),
    "overflow_margin": None,  # a finite number in (0, _MAX_MARGIN]
    "fp32_math": FP32_MATHS,  # see converter.passes.fp32_math
    # the fp8 stage (converter.passes.fp8): recipe and shape gates
    "fp8_recipe": FP8_RECIPES,
    "fp8_align": lambda value, where: _check_count(value, where, low=1),
    "fp8_min_flops_per_token": lambda value, where: _check_count(value, where, low=0),
    "fp8_keep_first": lambda value, where: _check_bool(value, where),
    "fp8_keep_last": lambda value, where: _check_bool(value, where),
    # the fp8 fallback with calibration (converter.numerics.fp8_layers): per-GEMM SQNR floors in dB
    "fp8_min_sqnr_output": lambda value, where: _check_db(value, where),
    "fp8_min_sqnr_grad_input": lambda value, where: _check_db(value, where),
    "fp8_min_sqnr_grad_weight": lambda value, where: _check_db(value, where),
}
#: the largest overflow margin: beyond fp16's largest finite value every nonzero value "overflows"
_MAX_MARGIN = 65504.0
_GLOB_CHARS = re.compile(r"[*?\[]")


class RulesError(MpconvertError, ValueError):
    """A rule file is malformed; the message names the file, the key path and a fix."""


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _line_of(text: str, table: str, key: str) -> Optional[int]:
    """Best-effort line number of ``key`` inside ``[table]`` (tomllib reports lines only for syntax errors)."""
    return _key_lines(text).get((table, key))


def _key_lines(text: str) -> dict[tuple[str, str], int]:
    """``{(table, key): line}`` for the first line of each key, in one pass over ``text`` (so that
    naming the line of every entry costs linear time, not a scan of the file per entry)."""
    found: dict[tuple[str, str], int] = {}
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = _HEADER.match(stripped)
        if header and not stripped.startswith("[["):
            current = header.group(1).strip().strip('"')
            continue
        if current is None or not stripped:
            continue
        key = _KEY_AT_START.match(stripped)
        if key is not None:
            quoted = key.group(1) if key.group(1) is not None else key.group(2)
            found.setdefault((current, quoted if quoted is not None else key.group(3).rstrip()), i)
    return found


_HEADER = re.compile(r"^\[\s*([^\]]+?)\s*\]")
_KEY_AT_START = re.compile(r"""^(?:"([^"]*)"|'([^']*)'|([^="'\s][^="']*?))\s*=""")


@dataclass(frozen=True)
class Rule:
    """One entry of a match table."""

    level: str  # one of LEVELS or "default"
    pattern: str
    precision: str
    reason: str = ""
    message: str = ""
    file: str = BUILTIN
    order: int = 0  # global read order; later wins among equals
    op: str = ""  # module rules only: restrict the rule to ops matching this pattern (an ``ops`` entry)
    scope: str = "subtree"  # module rules only: "self" (the module's own ops) or "subtree" (and its children's)

    def __post_init__(self) -> None:
        if self.level not in LEVELS + ("default",):
            raise RulesError(f"{self.file}: unknown rule table {self.level!r}{_suggest(self.level, LEVELS)}")
        if self.precision not in RULE_PRECISIONS:
            raise RulesError(
                f"{self.file}: [{self.level}].{self.pattern}: unknown precision {self.precision!r}"
                f"{_suggest(self.precision, RULE_PRECISIONS)} (valid: {', '.join(RULE_PRECISIONS)})"
            )

        if self.scope not in SCOPES:
            raise RulesError(f"{self.file}: [{self.level}].{self.pattern}: scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    @property
    def is_glob(self) -> bool:
        return bool(_GLOB_CHARS.search(self.pattern))

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    @property
    def ref(self) -> RuleRef:
        pattern = f"{self.pattern}.ops.{self.op}" if self.op else self.pattern
        return RuleRef(file=self.file, table=cast(RuleTable, self.level), pattern=pattern)

    def to_dict(self) -> dict:
        out = {"level": self.level, "pattern": self.pattern, "precision": self.precision, "file": self.file}
        if self.op:
            out["op"] = self.op
        if self.level in ("module", "module_type"):
            out["scope"] = self.scope
        if self.reason:
            out["reason"] = self.reason
        if self.message:
            out["message"] = self.message
        return out


@dataclass(frozen=True)
class Rules:
    """An ordered, layered set of rules; build with :func:`load_rules` or :meth:`from_dict`."""

    rules: tuple[Rule, ...] = ()
    files: tuple[str, ...] = ()
    settings: Mapping[str, object] = field(default_factory=dict)
    #: setting -> the file that set it last (the provenance of a decision a threshold makes)
    setting_files: Mapping[str, str] = field(default_factory=dict)
    if TYPE_CHECKING:  # the lookup indexes __post_init__ sets per instance (ClassVar: not dataclass fields)
        _index: ClassVar[dict[str, tuple[dict[str, list[Rule]], list[tuple[re.Pattern[str], Rule]]]]]
        _cache: ClassVar[dict[str, dict[Any, Any]]]
        _default: ClassVar[Optional[Rule]]
        _layer: ClassVar[dict[Rule, int]]

    def __post_init__(self) -> None:
        # Lookup indexes (not part of the value): exact patterns by name, globs compiled once, and
        # per-name caches, so deciding a node costs a few dict lookups rather than a scan of all rules.
        index: dict[str, tuple[dict, list]] = {}
        for level in LEVELS:
            exact: dict[str, list[Rule]] = {}
            globs: list[tuple[re.Pattern, Rule]] = []
            for rule in self.rules:
                if rule.level != level:
                    continue
                if rule.is_glob:
                    globs.append((re.compile(fnmatch.translate(rule.pattern)), rule))
                else:
                    exact.setdefault(rule.pattern, []).append(rule)
            index[level] = (exact, globs)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_cache", {level: {} for level in LEVELS})
        defaults = [rule for rule in self.rules if rule.level == "default"]
        object.__setattr__(self, "_default", defaults[-1] if defaults else None)
        # each rule's file position in the layering (files read in turn; one read twice counts twice)
        layer, previous, positions = -1, None, {}
        for rule in sorted(self.rules, key=lambda r: r.order):
            layer += rule.file != previous
            previous, positions[rule] = rule.file, layer
        object.__setattr__(self, "_layer", positions)

    def _op_rules(self, op: str, alias: str) -> list[tuple[Rule, bool]]:
        """The op rules matching ``op`` or ``alias``, each once, with whether it matched the alias."""
        named = self._rules_matching("op", alias) if alias else ()
        return [(rule, True) for rule in named] + [(rule, False) for rule in self._rules_matching("op", op)
                                                   if rule not in named]

    def _rules_matching(self, level: str, name: str) -> tuple[Rule, ...]:
        cache = self._cache[level]
        hit = cache.get(name)
        if hit is None:
            exact, globs = self._index[level]
            hit = tuple(exact.get(name, ())) + tuple(rule for regex, rule in globs if regex.match(name))
            cache[name] = hit
        return hit

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping, *, file: str = "<dict>", text: str = "", start: int = 0) -> "Rules":
        """Validate one parsed rule file; every bad key raises :class:`RulesError`."""
        if not isinstance(data, Mapping):
            raise RulesError(f"{file}: a rule file must be a TOML table")
        known_ops = known_op_names()
        lines = _key_lines(text) if text else {}

        def where(table: str, key: str) -> str:
            line = lines.get((table, key))
            return f"{file}:{line}: [{table}].{key}" if line else f"{file}: [{table}].{key}"

        rules: list[Rule] = []
        settings: dict[str, object] = {}
        for top, body in data.items():
            if top not in _TOP_KEYS:
                raise RulesError(f"{file}: unknown table [{top}]{_suggest(top, _TOP_KEYS)} (valid: {', '.join(_TOP_KEYS)})")
            if not isinstance(body, Mapping):
                raise RulesError(f"{file}: [{top}] must be a table, got {type(body).__name__}")
            if top == "meta":
                continue
            if top == "settings":
                for key, value in body.items():
                    if key not in _SETTINGS:
                        raise RulesError(f"{where('settings', key)}: unknown setting{_suggest(key, _SETTINGS)}")
                    allowed = _SETTINGS[key]
                    if callable(allowed):
                        allowed(value, where("settings", key))
                    elif allowed is not None and value not in allowed:
                        raise RulesError(f"{where('settings', key)}: must be one of {', '.join(allowed)}, got {value!r}")
                    if allowed is None:
                        _check_number(value, where("settings", key))
                    settings[key] = value
                continue
            if top == "default":
                for key in body:
                    if key not in _RULE_KEYS:
                        raise RulesError(f"{where('default', key)}: unknown key{_suggest(key, _RULE_KEYS)}")
                entry = _entry(body, file, "default", "precision", where)
                if entry[0] in ("follow", "promote", "banned") + GEMM_PRECISIONS:
                    raise RulesError(f"{where('default', 'precision')}: the default must be half, fp16, bf16, fp32 or tf32")
                rules.append(Rule("default", "*", entry[0], entry[1], entry[2], file, start + len(rules)))
                continue
            for pattern, value in body.items():
                if not isinstance(pattern, str) or not pattern:
                    raise RulesError(f"{file}: [{top}] has an empty pattern")
                _check_pattern(pattern, where(top, pattern))
                ops = None
                scope = default_scope(pattern)
                if top in ("module", "module_type") and isinstance(value, Mapping) and "ops" in value:
                    value = dict(value)
                    ops = value.pop("ops")
                    if not isinstance(ops, Mapping):
                        raise RulesError(f"{where(top, pattern)}.ops: must be a table of op = precision")
                if top in ("module", "module_type") and isinstance(value, Mapping) and "scope" in value:
                    value = dict(value)
                    scope = value.pop("scope")
                    if scope not in SCOPES:
                        raise RulesError(f"{where(top, pattern)}.scope: must be \"self\" (the module's own ops) or "
                                         f"\"subtree\" (its child modules' ops too), got {scope!r}")
                precision, reason, message = _entry(value, file, top, pattern, where)
                for op_pattern, op_value in (ops or {}).items():
                    key = f"{pattern}.ops.{op_pattern}"
                    _check_pattern(op_pattern, where(top, key))
                    op_precision, op_reason, op_message = _entry(op_value, file, top, key, where)
                    _check_op_name(op_pattern, known_ops, where(top, key))
                    if op_precision in GEMM_PRECISIONS:
                        _check_fp8_op(op_pattern, known_ops, where(top, key))
                    if op_precision == "banned" and not op_message:
                        raise RulesError(f"{where(top, key)}: a banned rule needs a 'message' telling the user what to do instead")
                    rules.append(Rule(top, pattern, op_precision, op_reason or reason, op_message, file, start + len(rules),
                                      op=op_pattern, scope=scope if top in ("module", "module_type") else "subtree"))
                if top == "op":
                    _check_op_name(pattern, known_ops, where(top, pattern))
                    if precision in GEMM_PRECISIONS:
                        _check_fp8_op(pattern, known_ops, where(top, pattern))
                if precision == "banned" and not message:
                    raise RulesError(f"{where(top, pattern)}: a banned rule needs a 'message' telling the user what to do instead")
                rules.append(Rule(top, pattern, precision, reason, message, file, start + len(rules),
                                  scope=scope if top in ("module", "module_type") else "subtree"))
        return cls(rules=tuple(rules), files=(file,), settings=settings, setting_files={key: file for key in settings})

    @classmethod
    def from_file(cls, path: Union[str, Path], *, start: int = 0) -> "Rules":
        path = Path(path)
        if "\x00" in str(path):
            raise RulesError(f"{str(path)!r}: the rules file name contains a NUL byte; pass a real file name")
        if not path.is_file():
            raise RulesError(f"{path}: rules file not found; pass an existing .toml file (built-in files are in {rules_dir()})")
        from converter.rules.bounds import too_deep, too_large

        why = too_large(path.stat().st_size)  # bounded cost: size and depth before the parser (rules/bounds.py)
        if why is not None:
            raise RulesError(f"{path}: {why}")
        try:
            text = path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark is accepted and dropped
        except UnicodeDecodeError as exc:
            raise RulesError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the rules file as UTF-8") from None
        why = too_deep(text)
        if why is not None:
            raise RulesError(f"{path}: {why}")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RulesError(f"{path}: TOML syntax error: {exc}; fix the syntax (see https://toml.io)") from None
        except RecursionError:
            raise RulesError(f"{path}: the TOML nests too deeply for the parser; a rule file needs at most 3 levels "
                             "([table], key, { precision = ... })") from None
        label = path.name if path.resolve().parent == rules_dir().resolve() else str(path)
        return cls.from_dict(data, file=label, text=text, start=start)

    def __add__(self, other: "Rules") -> "Rules":
        """Layer ``other`` on top of ``self``: its rules win ties (they are read later)."""
        offset = len(self.rules)
        shifted = tuple(dataclasses.replace(r, order=offset + r.order) for r in other.rules)
        return Rules(self.rules + shifted, self.files + other.files, {**self.settings, **other.settings},
                     {**self.setting_files, **other.setting_files})

    # ---- lookup -------------------------------------------------------------------------
    def by_level(self, level: str) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.level == level)

    def default_rule(self) -> Optional[Rule]:
        """The ``[default]`` rule read last, if any file has one."""
        return self._default

    def setting(self, key: str, fallback=None):
        return self.settings.get(key, fallback)

    def setting_ref(self, key: str) -> RuleRef:
        """The provenance of a setting: ``file:[settings].key`` of the file that set it last."""
        return RuleRef(file=self.setting_files.get(key, BUILTIN), table="settings", pattern=key)

    def matches_for(self, *, node: str, op: str, module_stack: Sequence[tuple[str, str]], alias: str = "") -> list[Match]:
        """Every rule that matches, best first (see the module docstring for the order).

        The sort key is (precedence level, -module depth, op-scoped first, -read order): a higher
        level first; among module rules the innermost module, and at one module an ``ops`` entry
        before the module's own precision; among equals the rule read last (later file wins).
        ``alias``: the node's op alias (``NodeInfo.op_alias``, e.g. ``weight_matmul``), matched by op
        patterns like ``op``; between two op patterns of one file, the one that names the alias wins.
        """
        found: list[tuple[tuple, Match]] = []
        for level in LEVELS:
            rank = level_rank(level)
            if level == "node":
                for rule in self._rules_matching(level, node):
                    found.append(((rank, 0, 1, -rule.order), Match(rule.ref, cast(RequestedPrecision, rule.precision), rank, level, "", rule.reason)))
                continue
            if level == "op":
                for rule, named in self._op_rules(op, alias):
                    key = (rank, 0, 1, -self._layer[rule], 0 if named else 1, -rule.order)
                    found.append((key, Match(rule.ref, cast(RequestedPrecision, rule.precision), rank, level, "", rule.reason)))
                continue
            idx = 0 if level == "module" else 1
            innermost = len(module_stack)
            for depth, entry in enumerate(module_stack, 1):
                for rule in self._rules_matching(level, entry[idx]):
                    named = bool(rule.op and alias and fnmatch.fnmatchcase(alias, rule.op))
                    if rule.op and not named and not fnmatch.fnmatchcase(op, rule.op):
                        continue
                    if rule.scope == "self" and depth != innermost:
                        continue  # the op runs in a child module of the one this rule names
                    key = (rank, -depth, 0 if rule.op else 1, -self._layer[rule], 0 if named else 1,
                           -rule.order)
                    found.append((key, Match(rule.ref, cast(RequestedPrecision, rule.precision), rank, level, entry[0], rule.reason)))
        default = self.default_rule()
        if default is not None:
            last = level_rank("default")
            found.append(((last, 0, 1, -default.order), Match(default.ref, cast(RequestedPrecision, default.precision), last, "default", "", default.reason)))
        found.sort(key=lambda item: item[0])
        return [m for _, m in found]

    def rule_for(self, match: Match) -> Rule:
        for rule in self.rules:
            if rule.ref == match.rule:
                return rule
        raise KeyError(match.rule)

    def to_dict(self) -> dict:
        """The effective configuration, echoed into the report."""
        return {"files": list(self.files), "settings": dict(self.settings), "rules": [r.to_dict() for r in self.rules]}


def default_scope(pattern: str) -> str:
    """``"self"`` for a rule whose pattern names a norm, else ``"subtree"`` (module doc). The rule's
    reason is not an argument: rewording it must not change what the rule reaches."""
    return "self" if _NORM.search(pattern) else "subtree"


def _check_number(value: object, where: str) -> None:
    """A numeric setting: a finite number in (0, _MAX_MARGIN] (NaN, inf and booleans are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RulesError(f"{where}: must be a number, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= _MAX_MARGIN:
        raise RulesError(f"{where}: must be a finite number above 0 and at most {_MAX_MARGIN:g}, got {value!r}; e.g. 2.0")


def _check_db(value: object, where: str) -> None:
    """An SQNR floor in dB: a finite number, or ``-inf`` (never falls back); NaN, +inf and booleans are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value == math.inf:
        raise RulesError(f"{where}: must be a number of dB (or -inf to never fall back), got {value!r}; e.g. 18.0")


def _check_pattern(pattern: str, where: str) -> None:
    """Patterns are names or fnmatch globs: no NUL bytes, no unclosed ``[`` (fnmatch would read it
    as a literal bracket, so the rule would silently match nothing)."""
    if "\x00" in pattern:
        raise RulesError(f"{where.replace(chr(0), '?')}: the pattern {pattern!r} contains a NUL byte; remove it")
    i = 0
    while i < len(pattern):
        if pattern[i] != "[":
            i += 1
            continue
        j = i + 1
        if pattern[j:j + 1] == "!":
            j += 1
        if pattern[j:j + 1] == "]":
            j += 1
        close = pattern.find("]", j)
        if close < 0:
            raise RulesError(f"{where}: unclosed '[' at position {i} of the glob {pattern!r}; close it with ']' "
                             "or write '[[]' for a literal '['")
        i = close + 1


def _check_count(value: object, where: str, *, low: int) -> None:
    """An integer setting of at least ``low`` (booleans and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RulesError(f"{where}: must be an integer of at least {low}, got {value!r}")


def _check_bool(value: object, where: str) -> None:
    if not isinstance(value, bool):
        raise RulesError(f"{where}: must be true or false, got {value!r}")


def _check_fp8_op(pattern: str, known_ops: frozenset, where: str) -> None:
    """An ``fp8`` op rule must name only GEMMs the fp8 kernels run (a glob: every known op it matches)."""
    named = {o for o in known_ops if fnmatch.fnmatchcase(o, pattern)} if _GLOB_CHARS.search(pattern) else {pattern}
    others = sorted(named - FP8_OPS)
    if others:
        raise RulesError(f"{where}: fp8 is a GEMM compute mode: op {others[0]!r} is not one of the fp8 GEMMs "
                         f"({', '.join(sorted(FP8_OPS))}); mark it half, bf16 or fp32 instead")


def _check_op_name(pattern: str, known_ops: frozenset, where: str) -> None:
    if pattern[:1].isupper():
        # a custom autograd Function's op name is its class name (passes.autograd_fns); a known op in
        # capitals (``Linear``) is still a typo of the op name
        lowered = pattern.lower()
        if lowered in known_ops:
            raise RulesError(f"{where}: unknown op name {pattern!r}; did you mean {lowered!r}? (a capitalised op name "
                             "names a custom autograd Function class)")
        return
    if not _GLOB_CHARS.search(pattern):
        if pattern not in known_ops:
            raise RulesError(f"{where}: unknown op name {pattern!r}{_suggest(pattern, known_ops)}")
    elif not any(fnmatch.fnmatchcase(o, pattern) for o in known_ops):
        raise RulesError(f"{where}: the pattern matches no known op name")


def _entry(value, file: str, table: str, key: str, where) -> tuple[str, str, str]:
    if isinstance(value, str):
        precision, reason, message = value, "", ""
    elif isinstance(value, Mapping):
        valid = _MODULE_RULE_KEYS if table in ("module", "module_type") and ".ops." not in key else _RULE_KEYS
        for sub in value:
            if sub not in _RULE_KEYS:
                raise RulesError(f"{where(table, key)}.{sub}: unknown key{_suggest(sub, valid)} (valid: {', '.join(valid)})")
        if "precision" not in value:
            raise RulesError(f"{where(table, key)}: missing 'precision' (one of {', '.join(RULE_PRECISIONS)})")
        precision = value["precision"]
        reason = value.get("reason", "")
        message = value.get("message", "")
        for name, text in (("reason", reason), ("message", message)):
            if not isinstance(text, str):
                raise RulesError(f"{where(table, key)}.{name}: must be a string, got {type(text).__name__}")
    else:
        raise RulesError(f"{where(table, key)}: expected a precision string or a table with 'precision', got {type(value).__name__}")
    if not isinstance(precision, str) or precision not in RULE_PRECISIONS:
        raise RulesError(f"{where(table, key)}: unknown precision {precision!r}{_suggest(str(precision), RULE_PRECISIONS)} "
                         f"(valid: {', '.join(RULE_PRECISIONS)})")
    return precision, reason, message


def rules_dir() -> Path:
    """The directory of the built-in rule files (works for editable and normal installs)."""
    here = Path(__file__).resolve().parent
    packaged = here / "builtin"  # a normal install: rules/*.toml ship as converter.rules.builtin
    if packaged.is_dir():
        return packaged
    source = here.parent.parent / "rules"  # a source checkout or an editable install
    if source.is_dir():
        return source
    return Path(str(resources.files("converter.rules") / "builtin"))


def default_rules_path() -> Path:
    return rules_dir() / "default.toml"


def _builtin_or_path(item: Union[str, Path]) -> Path:
    if "\x00" in str(item):
        raise RulesError(f"{str(item)!r}: the rules file name contains a NUL byte; pass a real file name")
    path = Path(item)
    if not path.exists() and path.suffix == "" and (rules_dir() / f"{item}.toml").is_file():
        return rules_dir() / f"{item}.toml"  # "llm" -> the built-in rules/llm.toml
    return path


def load_rules(paths: Union[None, str, Path, Iterable[Union[str, Path]], Rules] = None, *, include_default: bool = True) -> Rules:
    """Load and layer rule files; later files override earlier ones.

    ``None`` gives the default rules. A bare name such as ``"llm"`` names a built-in file. The
    default rules are always the bottom layer unless ``include_default=False``, so a user file only
    needs the entries it changes.
    """
    if isinstance(paths, Rules):
        return paths
    if paths is None:
        items: list = []
    elif isinstance(paths, (str, Path)):
        items = [paths]
    else:
        items = list(paths)
    result = Rules.from_file(default_rules_path()) if include_default else Rules()
    for item in items:
        path = _builtin_or_path(item)
        if include_default and path.resolve() == default_rules_path().resolve():
            continue
        result = result + Rules.from_file(path)
    return result


def resolve_rules(rules) -> Rules:
    """The API's ``rules=`` argument: a path, a list of paths, a :class:`Rules`, or None."""
    return load_rules(rules)

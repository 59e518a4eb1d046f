"""What each stage tells the report, as frozen typed records; torch-free.

A conversion's report carries, besides its rows (:mod:`converter.report.schema`), the facts the
stages found: how the run went (:class:`RunFacts`), what capture saw (:class:`CaptureFacts`), what the
lowerings chose (:class:`LoweringFacts`), the fp8 section (:class:`Fp8Facts`), the device advice
(:class:`DeviceAdvice`), the optional inputs (:class:`OptionalInputs`) and where a checkpoint folder's
model came from (:class:`SourceFacts`). :class:`StageRecords` holds them all (``Report.records``).

One schema for the writer and the reader: each field names its report.json key and the JSON types
it may hold. ``to_dict()`` gives the top-level keys of report.json exactly as they are written;
``from_dict()`` (the strict reader, :func:`converter.report.schema.problem`) checks a parsed file
against the same fields and raises :class:`RecordError` for a value of the wrong type. A section
that is absent reads as ``None``; a key missing inside a section reads as the field's default, so
that the reports of older versions still read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, TypeVar

from converter.ir.errors import MpconvertError

__all__ = ["RecordError", "RunFacts", "CaptureFacts", "LoweringFacts", "Fp8Facts", "DeviceAdvice", "OptionalInputs",
           "SourceFacts", "StageRecords", "Timings", "RECORD_KEYS"]

#: stage name -> seconds, or a group of them (``{"stages": {"capture": 0.1}}``)
Timings = Mapping[str, Any]

_R = TypeVar("_R", bound="_Record")
_NUM = (int, float)
_OPT_STR = (str, type(None))


class RecordError(MpconvertError, ValueError):
    """A report section whose value has the wrong type (a file edited by hand or not written by mpconvert);
    ``what`` says which section and what it holds."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"report.json: {what}; the file was edited or not written by mpconvert, "
                         "rerun mpconvert to write it again")


def _key(json_key: str, types: tuple[type, ...], *, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING,
         read: Optional[Callable[[Any], Any]] = None) -> Any:
    """A record field: its report.json key, the JSON types it may hold, how the reader restores it."""
    meta = {"key": json_key, "types": types, "read": read}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _dim_keys(value: Any) -> Any:
    """``{input: {dim: ...}}`` with JSON's string dims (``"1"``) read back as the ints the writer had."""
    if not isinstance(value, dict):
        return value
    return {name: {int(d) if isinstance(d, str) and d.isdigit() else d: v for d, v in dims.items()}
            if isinstance(dims, dict) else dims for name, dims in value.items()}


def _type_names(types: tuple[type, ...]) -> str:
    names = {str: "a string", int: "a number", float: "a number", dict: "an object", list: "a list", bool: "true/false",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _check(where: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise RecordError(f"its {where} is {_type_names((type(value),))}, not {_type_names(types)}")


@dataclass(frozen=True)
class _Record:
    """Fields declared with :func:`_key`; ``to_dict``/``from_dict`` read the declarations."""

    #: where the record's keys live in report.json ('' at the top level; else the key of its object)
    section: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.metadata["key"]: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.metadata["key"] for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls: type[_R], data: Mapping[str, Any]) -> _R:
        values = {}
        for f in dataclasses.fields(cls):
            key = f.metadata["key"]
            if key not in data:
                continue  # an older report: the field's default
            value = data[key]
            _check(f"{cls.section}.{key}" if cls.section else repr(key), value, f.metadata["types"])
            values[f.name] = f.metadata["read"](value) if f.metadata["read"] is not None else value
        try:
            return cls(**values)
        except TypeError:  # a required field absent
            missing = [f.metadata["key"] for f in dataclasses.fields(cls) if f.name not in values
                       and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            where = f" in {cls.section!r}" if cls.section else ""
            raise RecordError(f"no {', '.join(map(repr, missing))}{where}") from None


@dataclass(frozen=True)
class RunFacts(_Record):
    """How the run went: the tracers that failed and why, the stages' seconds, the options that shape the report.

    ``timings`` is the mapping the pipeline fills as its stages run (``Conversion.timings`` is the same one)."""

    capture_errors: Mapping[str, Any] = _key("capture_errors", (dict,), factory=dict)
    timings: Timings = _key("timings", (dict,), factory=dict)
    opt_level: str = _key("opt_level", (str,), default="O1")
    device: Optional[str] = _key("device", _OPT_STR, default=None)


@dataclass(frozen=True)
class CaptureFacts(_Record):
    """What capture found: the dynamic dims (and why, their ranges, the narrowed and tied ones), train/eval, the cache."""

    dynamic_dims: Mapping[str, Any] = _key("dynamic_dims", (dict,), factory=dict)
    shapes: str = _key("shapes", (str,), default="")
    narrowed_dims: Mapping[str, Any] = _key("narrowed_dims", (dict,), factory=dict, read=_dim_keys)
    dynamic_ranges: Mapping[str, Any] = _key("dynamic_ranges", (dict,), factory=dict, read=_dim_keys)
    tied_dims: Mapping[str, Any] = _key("tied_dims", (dict,), factory=dict, read=_dim_keys)
    #: the train/eval note's text (``Report.modes`` is the typed note)
    modes: str = _key("modes", (str,), default="")
    #: why the graph returns no key/value cache, or ''
    cache: Optional[str] = _key("cache", _OPT_STR, default="")


@dataclass(frozen=True)
class LoweringFacts(_Record):
    """What the lowerings changed and chose, the custom ops of other libraries, checkpoint regions, simplifications."""

    lowered: list[Any] = _key("lowered", (list,), factory=list)
    lowering: list[Any] = _key("lowering", (list,), factory=list)
    library_ops: list[Any] = _key("library_ops", (list,), factory=list)
    checkpoint: Mapping[str, Any] = _key("checkpoint", (dict,), factory=dict)
    simplified: Mapping[str, Any] = _key("simplified", (dict,), factory=dict)


@dataclass(frozen=True)
class Fp8Facts(_Record):
    """report.json's ``"fp8"`` object (:func:`converter.report.fp8.fp8_section`): the recipe, the fp8 layers and why others are not."""

    section: ClassVar[str] = "fp8"

    recipe: str = _key("recipe", (str,))
    layers: list[Any] = _key("layers", (list,), factory=list)
    count: int = _key("count", (int,), default=0)
    flops: float = _key("flops", _NUM, default=0)
    gemm_flops: float = _key("gemm_flops", _NUM, default=0)
    flops_share: float = _key("flops_share", _NUM, default=0.0)
    thresholds: Mapping[str, Any] = _key("thresholds", (dict,), factory=dict)
    #: per-layer numerics rows when calibration ran, else None
    numerics: Optional[list[Any]] = _key("numerics", (list, type(None)), default=None)
    fallback: list[Any] = _key("fallback", (list,), factory=list)
    kept_bf16: list[Any] = _key("kept_bf16", (list,), factory=list)


@dataclass(frozen=True)
class DeviceAdvice(_Record):
    """The slow-half advice of :func:`converter.api.convert` (a :class:`SlowHalfWarning`'s text), or None: none."""

    text: Optional[str] = _key("device_advice", _OPT_STR, default=None)


@dataclass(frozen=True)
class OptionalInputs(_Record):
    """The original forward's optional arguments the graph keeps optional, and the required ones (and why)."""

    section: ClassVar[str] = "optional_inputs"

    optional: list[Any] = _key("optional", (list,), factory=list)
    required: Mapping[str, Any] = _key("required", (dict,), factory=dict)


@dataclass(frozen=True)
class SourceFacts:
    """Where a checkpoint folder's model came from (:mod:`converter.cli.hfmodel`): ``facts`` as written, ``note`` its prose."""

    facts: Mapping[str, Any]

    @property
    def note(self) -> str:
        note = self.facts.get("note")
        return note if isinstance(note, str) else ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.facts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SourceFacts":
        _check("'source'", data, (dict,))
        _check("source.note", data.get("note", ""), (str,))
        return cls(dict(data))


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data[key]
    _check(repr(key), value, (dict,))
    section: Mapping[str, Any] = value
    return section


@dataclass(frozen=True)
class StageRecords:
    """Every stage's facts on one report; each is None where that stage did not report (``audit``: no advice).

    ``merged``: a report merged from the regions of a partial conversion, which has no ``"fp8"`` key
    (a one-graph report has it, ``null`` without fp8). The ``device_profile`` key is the report's own
    typed field (:class:`converter.numerics.profile.DeviceProfile`); the reader checks it is an object or null."""

    run: Optional[RunFacts] = None
    capture: Optional[CaptureFacts] = None
    lowering: Optional[LoweringFacts] = None
    fp8: Optional[Fp8Facts] = None
    advice: Optional[DeviceAdvice] = None
    optional_inputs: Optional[OptionalInputs] = None
    source: Optional[SourceFacts] = None
    merged: bool = False

    def to_dict(self) -> dict[str, Any]:
        """report.json's top-level keys for these facts, in the order they are written."""
        out: dict[str, Any] = {}
        if self.run is not None:
            out.update(self.run.to_dict())
            if self.merged:  # a merged report has always written its run facts in this order
                out = {**{k: v for k, v in out.items() if k != "capture_errors"}, "capture_errors": self.run.capture_errors}
        if self.lowering is not None:
            out.update(lowered=self.lowering.lowered, lowering=self.lowering.lowering)
        if self.capture is not None:
            out.update(self.capture.to_dict())
        if self.lowering is not None:
            out.update(library_ops=self.lowering.library_ops, checkpoint=self.lowering.checkpoint,
                       simplified=self.lowering.simplified)
        if not self.merged:
            out["fp8"] = self.fp8.to_dict() if self.fp8 is not None else None
        for record in (self.advice, self.optional_inputs):
            if record is not None:
                out.update(record.to_dict() if isinstance(record, DeviceAdvice) else {"optional_inputs": record.to_dict()})
        if self.source is not None:
            out["source"] = self.source.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageRecords":
        """The records of a parsed report.json (the strict reader); :class:`RecordError` names a mistyped section."""
        def present(record: type[_Record]) -> bool:
            return any(key in data for key in record.keys())

        fp8 = data.get("fp8")
        profile = data.get("device_profile")
        if profile is not None:
            _check("'device_profile'", profile, (dict,))
        return cls(
            run=RunFacts.from_dict(data) if present(RunFacts) else None,
            capture=CaptureFacts.from_dict(data) if present(CaptureFacts) else None,
            lowering=LoweringFacts.from_dict(data) if present(LoweringFacts) else None,
            fp8=Fp8Facts.from_dict(_section(data, "fp8")) if fp8 is not None else None,
            advice=DeviceAdvice.from_dict(data) if present(DeviceAdvice) else None,
            optional_inputs=OptionalInputs.from_dict(_section(data, "optional_inputs")) if "optional_inputs" in data else None,
            source=SourceFacts.from_dict(data["source"]) if "source" in data else None,
            merged="fp8" not in data)


#: every top-level report.json key a :class:`StageRecords` may write, in the order a one-graph report writes them
RECORD_KEYS: tuple[str, ...] = (*RunFacts.keys(), "lowered", "lowering", *CaptureFacts.keys(), "library_ops", "checkpoint",
                                "simplified", "fp8", "device_advice", "optional_inputs", "source")

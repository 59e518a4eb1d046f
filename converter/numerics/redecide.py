"""Re-deciding nodes after calibration: what *decide* said, and re-running placement with overrides.

Shared by the overflow fallback (:mod:`converter.numerics.calibrate`) and the accuracy search
(:mod:`converter.numerics.search`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import tomllib
import torch
import torch.fx

from converter.ir.meta import META_DECISION, Decision
from converter.passes.decide import decide
from converter.passes.place.stage import place
from converter.rules.loader import Rules, rules_dir

__all__ = ["PlaceSettings", "setting_source", "fresh_decisions", "replace_decisions"]


@dataclass(frozen=True)
class PlaceSettings:
    """How the conversion placed its casts, so that a re-placement after re-deciding matches it.

    The arguments of :func:`converter.passes.place.stage.place` that :func:`converter.convert` used.
    """

    target: str
    strategy: str = "mincut"
    keep_io_types: bool = True
    opt_level: str = "O1"

    def run(self, gm: torch.fx.GraphModule) -> None:
        """Run placement on ``gm`` with these settings."""
        place(gm, target=self.target, strategy=self.strategy, keep_io_types=self.keep_io_types, opt_level=self.opt_level)


def setting_source(rules: Rules, key: str) -> Optional[str]:
    """The label of the last rule file whose ``[settings]`` sets ``key`` (None: nobody set it)."""
    if key not in rules.settings:
        return None
    found = None
    for label in rules.files:
        path = Path(label)
        if not path.is_file():
            path = rules_dir() / label
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if isinstance(data.get("settings"), dict) and key in data["settings"]:
            found = label
    return found


def fresh_decisions(gm: torch.fx.GraphModule, rules: Rules, target: str) -> dict[str, Decision]:
    """What *decide* says for every node, without placement (used to reset ``follow`` nodes)."""
    saved = {n: n.meta.get(META_DECISION) for n in gm.graph.nodes}
    try:
        decide(gm, rules, precision=target)
        return {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}
    finally:
        for n, d in saved.items():
            if d is None:
                n.meta.pop(META_DECISION, None)
            else:
                n.meta[META_DECISION] = d


def replace_decisions(
    gm: torch.fx.GraphModule,
    overrides: Mapping[str, Decision],
    *,
    fresh: Mapping[str, Decision],
    settings: PlaceSettings,
) -> None:
    """Apply ``overrides`` and re-run placement.

    Every node that *decide* left unresolved (``follow``/``promote``/alias) gets its pre-placement
    decision back (from ``fresh``), unless overridden; concrete decisions stay as they are.
    """
    for node in gm.graph.nodes:
        if node.name in overrides:
            node.meta[META_DECISION] = overrides[node.name]
            continue
        before = fresh.get(node.name)
        if before is not None and before.precision in ("follow", "promote", "alias") and META_DECISION in node.meta:
            node.meta[META_DECISION] = before
    settings.run(gm)

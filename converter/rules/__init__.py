"""Rule files: loading, validation and matching. The built-in TOML files ship as package data.

The loader's names are imported on first use (PEP 562), so that the torch-free
:mod:`converter.rules.precedence` can be imported without the loader (and torch).
"""
from __future__ import annotations

__all__ = ["Rule", "Rules", "RulesError", "PRECISIONS", "LEVELS", "load_rules", "default_rules_path", "rules_dir", "resolve_rules"]


def __getattr__(name: str):
    if name in __all__:
        from converter.rules import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'converter.rules' has no attribute {name!r}")

"""Rule files: loading, validation and matching. The built-in TOML files ship as package data."""
from converter.rules.loader import *  # noqa: F401,F403
from converter.rules.loader import __all__  # noqa: F401

"""``python -m converter`` is the ``mpconvert`` command."""
from .cli import main

raise SystemExit(main())

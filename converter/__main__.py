"""``python -m converter`` is the ``mpconvert`` command."""
from converter.cli.main import main

raise SystemExit(main())

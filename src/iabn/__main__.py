"""``python -m iabn``: the same as the ``iabn`` command."""

from .tools.cli import main

raise SystemExit(main())

"""``python -m iabn``: the same as the ``iabn`` command."""

from .cli import main

raise SystemExit(main())

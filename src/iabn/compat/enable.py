"""The one-line opt-in: ``import iabn.compat.enable`` runs :func:`iabn.compat.install`, after
which ``import inplace_abn`` gives :mod:`iabn.compat` (unless a real one is installed)."""

from . import install

install()

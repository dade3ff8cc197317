"""Moved to :mod:`iabn.tools.outputs` (which imports no torch, so that the commands check their
output paths before importing it); this name stays for code that imported it here."""

from ..outputs import (
    OutputPathError,
    check_output_file,
    check_output_folder,
    write_atomic,
    write_text_atomic,
)

__all__ = ["OutputPathError", "check_output_file", "check_output_folder", "write_atomic",
           "write_text_atomic"]

"""The data error the tools report as a user error (exit status 2, one line), in a module of
its own so that light modules (:mod:`.label_sets`) raise it without importing torchvision."""


class DataLayoutError(ValueError):
    """A data folder does not have the layout a dataset expects (the message names the
    folder or file and what was expected)."""


__all__ = ["DataLayoutError"]

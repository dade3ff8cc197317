"""The tools moved to iabn.tools; their old paths (iabn.training, iabn.cli, ...) still
import for one release, as the very same module objects, with a DeprecationWarning naming the
new path (src/iabn/_moved.py)."""

import importlib
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import iabn
from iabn import _moved

TOOLS = Path(iabn.__file__).parent / "tools"


#: Modules written under iabn.tools after the move: they never had an old path.
SINCE_THE_MOVE = ("arguments", "outputs")


def _tool_modules():
    """Every module under iabn/tools, by its new name, found from the files (nothing imported)."""
    names = []
    for path in sorted(TOOLS.rglob("*.py")):
        parts = path.relative_to(TOOLS).with_suffix("").parts
        if parts == ("__init__",) or parts[0] in SINCE_THE_MOVE:
            continue
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join(("iabn", "tools", *parts)))
    return names


NEW_NAMES = _tool_modules()


def _old(new):
    return new.replace("iabn.tools.", "iabn.", 1)


@pytest.fixture(autouse=True)
def _fresh_old_names():
    """Each test imports the old names anew (the warning comes once per name and process), and
    leaves sys.modules as it found them."""
    saved = {name: module for name, module in sys.modules.items()
             if _moved.new_name(name) is not None}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [name for name in sys.modules if _moved.new_name(name) is not None]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_every_moved_module_is_found():
    """The parametrization below covers each moved package and file (guards _tool_modules)."""
    assert {name.split(".")[2] for name in NEW_NAMES} == _moved.MOVED
    assert "iabn.tools.training.config" in NEW_NAMES
    assert "iabn.tools.bench.pixels" in NEW_NAMES


@pytest.mark.parametrize("new", NEW_NAMES)
def test_old_path_is_the_new_module_and_warns(new):
    old = _old(new)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        module = importlib.import_module(old)  # a submodule's parent warns too
    assert module is importlib.import_module(new)
    messages = [str(warning.message) for warning in record]
    assert all(warning.category is DeprecationWarning for warning in record), messages
    expected = f"{old} is deprecated: it moved to {new} "
    assert any(message.startswith(expected) for message in messages), messages
    assert sys.modules[old] is sys.modules[new]
    assert module.__name__ == new  # the module keeps its own identity


def test_from_import_of_old_paths():
    with pytest.warns(DeprecationWarning) as record:
        from iabn.bench.pixels import largest_fitting
        from iabn.training.config import ConfigError
    from iabn.tools.bench.pixels import largest_fitting as new_largest_fitting
    from iabn.tools.training.config import ConfigError as NewConfigError

    assert largest_fitting is new_largest_fitting
    assert ConfigError is NewConfigError
    with pytest.raises(ConfigError):  # an error raised by the new path is caught by the old
        raise NewConfigError("x")
    messages = [str(warning.message) for warning in record]
    assert any("iabn.tools.bench.pixels" in message for message in messages)
    assert any("iabn.tools.training.config" in message for message in messages)


def test_warning_points_at_the_importing_line():
    with pytest.warns(DeprecationWarning) as record:
        import iabn.metrics  # noqa: F401
    assert len(record) == 1
    assert record[0].filename == __file__


def test_warns_once_per_old_name():
    with pytest.warns(DeprecationWarning):
        import iabn.losses
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import iabn.losses as again  # found in sys.modules: no second warning
    import iabn.tools.losses

    assert again is iabn.tools.losses


def test_monkeypatching_through_the_old_path_reaches_the_new(monkeypatch):
    with pytest.warns(DeprecationWarning):
        import iabn.bench as old_bench
    import iabn.tools.bench

    monkeypatch.setattr(old_bench, "write_text_atomic", "patched")
    assert iabn.tools.bench.write_text_atomic == "patched"


def test_pickle_by_old_class_path_loads_the_new_class():
    """Pickles written before the move name classes by their old module path."""
    from iabn.tools.training.config import ConfigError

    # Protocol 0 names the class's module as a text line, so it can be edited in place.
    data = pickle.dumps(ConfigError("x"), protocol=0).replace(b"iabn.tools.training.config",
                                                               b"iabn.training.config")
    assert b"iabn.training.config" in data
    with pytest.warns(DeprecationWarning):
        loaded = pickle.loads(data)
    assert type(loaded) is ConfigError


def test_missing_module_under_an_old_path_names_the_new_path():
    with pytest.warns(DeprecationWarning):
        import iabn.training  # noqa: F401  (the parent's own warning, not the one tested)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and warns about nothing
        with pytest.raises(ModuleNotFoundError, match=r"iabn\.tools\.training\.no_such_module"):
            importlib.import_module("iabn.training.no_such_module")


def test_other_names_are_not_touched():
    assert _moved.new_name("iabn.models") is None
    assert _moved.new_name("iabn.tools.training") is None
    assert _moved.new_name("iabn") is None
    assert _moved.new_name("training") is None
    assert _moved.new_name("iabn.training.config") == "iabn.tools.training.config"


def _run(code):
    return subprocess.run([sys.executable, *code], capture_output=True, text=True, timeout=300)


def test_import_iabn_loads_no_tool():
    """Installing the finder imports nothing from the tools (import iabn stays light)."""
    result = _run(["-c", "import sys, iabn; from iabn import _moved\n"
                         "assert isinstance(sys.meta_path[0], _moved._MovedFinder)\n"
                         "print(sorted(n for n in sys.modules if n.startswith('iabn.') and "
                         "(n.startswith('iabn.tools') or _moved.new_name(n))))"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_python_m_old_cli_names_the_new_command():
    result = _run(["-m", "iabn.cli", "--version"])
    assert result.returncode != 0
    assert "iabn.cli moved to iabn.tools.cli" in result.stderr
    assert "python -m iabn" in result.stderr

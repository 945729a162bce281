"""The old names of the modules that moved into parity's rooms still import, as the very modules
they moved to (parity/_moved.py), and nothing in the project uses them. In process, under 1 s."""
import importlib

from parity._moved import MOVED
from tests.test_layering import users_of


def test_every_old_name_is_the_module_it_moved_to_and_so_are_its_submodules():
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert importlib.import_module("parity.engines.dump") is importlib.import_module("parity.diff.engines.dump")
    assert importlib.import_module("parity.watch.callfile") is importlib.import_module("parity.record.watch.callfile")
    from parity import capture, check, watch   # the public spellings of the old layout
    assert (capture.__name__, check.__name__, watch.__name__) == (
        "parity.record.capture", "parity.certify.check", "parity.record.watch")


def test_no_module_of_the_project_imports_an_old_name():
    assert users_of(MOVED) == []

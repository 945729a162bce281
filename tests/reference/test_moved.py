"""The old names of the modules that moved from reference/ to kimi/ (the model's files) still
import, as the very modules they moved to (reference/_moved.py), and nothing in the project uses
them. In process, under 1 s."""
import importlib

from reference._moved import MOVED
from tests.test_layering import users_of


def test_every_old_name_is_the_module_it_moved_to():
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    import reference.config
    from reference import checkpoint   # the spellings of code written before the move
    from reference.config import KimiConfig
    assert reference.config.KimiConfig is KimiConfig and checkpoint.__name__ == "kimi.checkpoint"


def test_no_module_of_the_project_imports_an_old_name():
    assert users_of(MOVED) == []

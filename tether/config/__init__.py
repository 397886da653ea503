"""The typed config of a tether run: the tree in tree.py (TetherConfig, load_config, ...), the Section
base in base.py, raw overrides in raw.py; each component's section beside it (rollout/config.py,
engine/config.py, ...).

The tree's names are re-exported here on first use, not at import: a component's section imports
``tether.config.base`` (which runs this file first), and the tree imports the components' sections, so
an eager import here would make them import each other."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.config.tree import *  # noqa: F403
    from tether.config.tree import ConfigError, Section, TetherConfig, config_from_dict, dump_config, load_config, public_dict  # noqa: F401


def __getattr__(name: str) -> Any:
    tree = importlib.import_module("tether.config.tree")
    try:
        return getattr(tree, name)
    except AttributeError:
        raise AttributeError(f"module 'tether.config' has no attribute {name!r}") from None

"""The raw config before validation: dotted command-line overrides, and user-function file specs
made absolute (against the config file's folder, or the working directory for overrides)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tether.errors import ConfigError


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    # YAML parsing gives overrides the same typing as the recipe file: 3 -> int, true -> bool, [1,2] -> list.
    value = yaml.safe_load(raw) if raw != "" else ""
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set dotted-path overrides on a raw (unvalidated) config dict; a number picks a list item, so
    ``eval.datasets.0.path=x`` changes one field of the first eval set and keeps the others."""
    for text in overrides:
        path, value = _parse_override(text)
        node = raw
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {text!r}: {'.'.join(path[:depth])} is a list of {len(node)} "
                                      f"items; {part!r} is not the index of one")
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:depth])!r} is a value, not a section")
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
    return raw


def resolve_spec(spec: Any, base: Path) -> Any:
    """A relative ``path/file.py:function`` spec made absolute against ``base``; anything else as is."""
    if not isinstance(spec, str) or ":" not in spec or spec.strip().startswith(("http://", "https://")):
        return spec
    target, _, attr = spec.strip().rpartition(":")
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        return spec  # a built-in name or a module:function
    path = Path(target).expanduser()
    return spec if path.is_absolute() else f"{(base / path).resolve()}:{attr}"


def resolve_function_specs(raw: dict, base: Path) -> dict:
    """Resolve the file specs of user functions (rewards, policy loss) in a raw config against ``base``:
    the config file's folder for values written in it, the working directory for overrides."""
    for section, key in (("rollout", "reward"), ("rollout", "group_reward"), ("rollout", "reward_post_process"),
                         ("rollout", "dynamic_filter"), ("rollout", "custom_generate_fn"),
                         ("rollout", "custom_rollout_fn"), ("algorithm", "policy_loss")):
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            node[key] = resolve_spec(node[key], base)
    environment = raw["rollout"].get("environment") if isinstance(raw.get("rollout"), dict) else None
    for key in ("action", "tool_parser"):  # functions an environment section names
        if isinstance(environment, dict) and isinstance(environment.get(key), str):
            environment[key] = resolve_spec(environment[key], base)
    factory = environment.get("factory") if isinstance(environment, dict) else None
    if not isinstance(environment, dict):
        pass
    elif isinstance(factory, str):
        environment["factory"] = resolve_spec(factory, base)
    elif isinstance(factory, dict):
        environment["factory"] = {k: resolve_spec(v, base) if isinstance(v, str) else v for k, v in factory.items()}
    datasets = raw.get("eval", {}).get("datasets") if isinstance(raw.get("eval"), dict) else None
    for dataset in datasets if isinstance(datasets, list) else []:
        if isinstance(dataset, dict) and "reward" in dataset:
            dataset["reward"] = resolve_spec(dataset["reward"], base)
    return raw

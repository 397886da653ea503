"""The served models this process can reach, by name: ``models`` for reward functions, ``ctx.models``
for generate functions. Filled by the rollout manager when it connects its engines
(tether/rollout/served.py holds the clients); empty anywhere else. Kept below everything that hands it
to user code (tether/importing.py binds it), so nothing imports upward to reach it."""

from __future__ import annotations

from typing import Any, Iterator, Mapping


class ServedModelError(RuntimeError):
    """A served model's engine answered with an error, or the name is not served."""


class ServedModels(Mapping[str, Any]):
    """name -> the served model's client; an unknown name is an error that lists the served ones."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}

    def set(self, models: dict[str, Any]) -> None:
        for old in self._models.values():
            old.close()
        self._models = dict(models)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._models[name]
        except KeyError:
            served = ", ".join(sorted(self._models)) or "none"
            raise ServedModelError(f"no served model named {name!r}: the run serves {served} "
                                   "(served_models: in the config)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)


MODELS = ServedModels()
"""This process's served models (the same object for the whole run: a function may keep it)."""

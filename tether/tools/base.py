"""The tool interface: a name, a description and a JSON schema of its arguments (what a chat template
shows the model, in OpenAI's function format), and an async call that always answers with text.

A tool's failure (bad arguments, a timeout, an exception inside it) is the tool's output to the model,
never an exception in the rollout: the policy sees what went wrong and the sample goes on. Only a
failure of the tool's infrastructure (its sandbox could not start, its server is gone) raises
ToolFailure: the sample is then tried again, and masked if it keeps failing (tether/rollout/failures.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tether.errors import SampleFailure, ToolFailure
from tether.progress import report_progress
from tether.run.faults import inject_fault


@dataclass
class ToolResult:
    output: str
    """What the model is shown."""
    ok: bool = True
    """False when the call failed (the output then says why); counted in rollout metrics."""


class Tool(ABC):
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""

    def schema(self) -> dict[str, Any]:
        """The tool as OpenAI's `tools` entry (what `apply_chat_template(..., tools=[...])` takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def __call__(self, arguments: dict[str, Any] | str) -> ToolResult:
        """Run the tool; every failure comes back as a ToolResult with ok=False, except ToolFailure (the
        tool's infrastructure failed: nothing for the model to learn from)."""
        if inject_fault("tool"):
            raise ToolFailure(f"tool {self.name}: injected fault (TETHER_INJECT_FAULTS)")
        if isinstance(arguments, str):  # the bare argument of a one-argument tool
            arguments = {next(iter(self.parameters.get("properties", {"input": None}))): arguments}
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return ToolResult(f"error: {self.name} needs {', '.join(missing)}", ok=False)
        try:
            return await self.run(**arguments)
        except SampleFailure:
            raise
        except Exception as err:  # noqa: BLE001 - the model is told; the rollout goes on
            return ToolResult(f"error: {type(err).__name__}: {err}", ok=False)
        finally:
            report_progress()

    # (*args, **arguments): each tool names its own keyword parameters (the schema's properties); typed
    # so, a subclass may declare them.
    @abstractmethod
    async def run(self, *args: Any, **arguments: Any) -> ToolResult:
        ...

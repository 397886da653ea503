"""Tools a generate function can call: one small interface, and the tools tether ships."""

from tether.tools.base import Tool, ToolResult
from tether.tools.calculator import Calculator
from tether.tools.python import PythonSandbox

__all__ = ["Calculator", "PythonSandbox", "Tool", "ToolResult"]

"""Tools a generate function can call: one small interface, and the tools tether ships."""

from tether.tools.base import Tool, ToolResult
from tether.tools.calculator import Calculator

__all__ = ["Calculator", "Tool", "ToolResult"]

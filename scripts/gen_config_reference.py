"""Write docs/reference/config.md from the config classes.

    python scripts/gen_config_reference.py           # rewrite the reference
    python scripts/gen_config_reference.py --check   # exit 1 when it is out of date

The reference is walked from ``tether.config.TetherConfig``: one heading per section (nested sections
and list items included), one heading per variant of a discriminated union (``rollout.schedule (mode:
fully_async)``), and per field its dotted name, type, default and docstring. Every section subclasses
``tether.config.base.Section`` (``use_attribute_docstrings=True``), so a field's docstring is its
``description``. Imports no torch, as ``tether.config`` does not.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

import annotated_types  # noqa: E402  (after the path fix above)
from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from tether.config import TetherConfig  # noqa: E402
from tether.config.base import Section  # noqa: E402

OUT = ROOT / "docs" / "reference" / "config.md"

HEADER = """# Config reference

Every field of a tether config, generated from the config classes (`tether/config/tree.py` and the
sections it assembles: `tether/rollout/config.py`, `tether/rollout/reasoning_gym_config.py`,
`tether/engine/config.py`) by `python scripts/gen_config_reference.py`; do not edit it by hand
(`tests/unit/test_docs.py` fails when it is out of date). How configs, overrides and `--dry-run` work:
[Configuration](../configuration.md).

A section keyed on a field (`rollout.schedule` on `mode`, `engine` on `backend`) is one of several
variants, each with its own fields; the key picks the variant, and a field of another variant is an
error. Overrides name a field by its dotted path (`rollout.schedule.max_staleness=2`); a list item by
its index (`eval.datasets.0.path=...`, written `eval.datasets[i]` below).
"""


# --------------------------------------------------------------------------- types


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Section)


def _unwrap(tp: Any) -> tuple[Any, list[Any]]:
    """``Annotated[X, meta...]`` -> (X, meta); anything else -> (tp, [])."""
    meta: list[Any] = []
    while typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        tp, meta = args[0], meta + list(args[1:])
    return tp, meta


def _union_members(tp: Any) -> list[Any] | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return list(typing.get_args(tp))
    return None


_BOUNDS = ((annotated_types.Ge, "ge", ">= {}"), (annotated_types.Gt, "gt", "> {}"),
           (annotated_types.Le, "le", "<= {}"), (annotated_types.Lt, "lt", "< {}"),
           (annotated_types.MinLen, "min_length", "at least {} item(s)"),
           (annotated_types.MaxLen, "max_length", "at most {} item(s)"))


def _constraints(meta: list[Any]) -> list[str]:
    """Bounds from pydantic's field metadata (``Field(ge=1)`` and the like), as ``>= 1``."""
    out = []
    for m in meta:
        if isinstance(m, FieldInfo):  # Annotated[X, Field(...)] inside a container
            out += _constraints(list(m.metadata))
        out += [text.format(getattr(m, attr)) for kind, attr, text in _BOUNDS if isinstance(m, kind)]
    return out


def type_text(tp: Any, field_meta: list[Any] | None = None) -> str:
    """A type as a recipe writer reads it: ``int | null``, ``"start" | "finish"``, ``list[str]``, with its
    bounds (``int (>= 1)``); ``field_meta``: the field's own metadata, where ``Field(ge=1)`` lands."""
    tp, meta = _unwrap(tp)
    bounds = _constraints(meta + list(field_meta or []))
    if tp is type(None):
        text = "null"
    elif tp is Any:
        text = "any"
    elif typing.get_origin(tp) is typing.Literal:
        text = " | ".join(json.dumps(v) for v in typing.get_args(tp))
    elif (members := _union_members(tp)) is not None:
        text = " | ".join(type_text(m) for m in members)
    elif typing.get_origin(tp) in (list, tuple, set, dict):
        args = ", ".join(type_text(a) for a in typing.get_args(tp))
        text = f"{typing.get_origin(tp).__name__}[{args}]" if args else typing.get_origin(tp).__name__
    elif _is_section(tp):
        text = "section"
    elif isinstance(tp, type):
        text = tp.__name__
    else:
        text = str(tp).replace("typing.", "")
    return f"{text} ({', '.join(bounds)})" if bounds else text


# --------------------------------------------------------------------------- the tree


@dataclass
class Nested:
    """A field that holds sections: one section, a list of them, or a union keyed on ``key``."""

    kind: str  # "section" | "list" | "dict" | "union"
    classes: list[type]
    key: str | None = None  # the discriminator of a union


def nested(field: FieldInfo) -> Nested | None:
    """The sections a field holds, or None for a plain value."""
    tp, meta = _unwrap(field.annotation)
    key = field.discriminator
    for m in meta:  # Annotated[Union[...], Field(discriminator=...)] kept inside the annotation
        if isinstance(m, FieldInfo) and m.discriminator:
            key = m.discriminator
    members = _union_members(tp)
    if members is not None:
        members = [m for m in (_unwrap(m)[0] for m in members) if m is not type(None)]
        if len(members) > 1:
            if all(_is_section(m) for m in members):
                return Nested("union", members, key if isinstance(key, str) else None)
            return None
        tp = members[0]
        if typing.get_origin(tp) is typing.Annotated or _union_members(tp):  # Optional[Annotated[Union, ...]]
            return nested(FieldInfo.from_annotation(tp))
    if _is_section(tp):
        return Nested("section", [tp])
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and _is_section(_unwrap(args[0])[0]):
        return Nested("list", [_unwrap(args[0])[0]])
    if origin is dict and len(args) == 2 and _is_section(_unwrap(args[1])[0]):
        return Nested("dict", [_unwrap(args[1])[0]])
    return None


def variant_name(cls: type, key: str | None) -> str:
    """The discriminator value that picks ``cls`` (its class name in a union without one)."""
    if key and key in cls.model_fields:
        field = cls.model_fields[key]
        tp, _ = _unwrap(field.annotation)
        if typing.get_origin(tp) is typing.Literal:
            return str(typing.get_args(tp)[0])
        if field.default is not PydanticUndefined:
            return str(field.default)
    return cls.__name__


def child_path(path: str, name: str, kind: str) -> str:
    base = f"{path}.{name}" if path else name
    return {"list": f"{base}[i]", "dict": f"{base}.<key>"}.get(kind, base)


# --------------------------------------------------------------------------- markdown


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose(text: str | None) -> str:
    """A docstring as one markdown line: whitespace collapsed, ``<`` outside code spans escaped (GitHub
    would take ``<id>`` for an HTML tag and drop it)."""
    text = " ".join((text or "").split())
    parts = re.split(r"(`+.+?`+)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def default_text(field: FieldInfo, holds: Nested | None) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, Section):
        if holds is not None and holds.kind == "union" and holds.key:
            return _code(f"{holds.key}: {variant_name(type(value), holds.key)}")
        return "its defaults"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return _code(repr(value))
    return _code(json.dumps(value, ensure_ascii=False))


@dataclass
class Block:
    """One heading of the reference: a section, a list item's section, or one variant of a union."""

    title: str
    path: str
    cls: type
    level: int
    intro: list[str]
    key: str | None = None  # the union's discriminator, listed first


def _blocks(cls: type, path: str, level: int, title: str, intro: list[str], key: str | None = None) -> list[Block]:
    """This section's block, then those of the sections under it, depth first in field order."""
    out = [Block(title, path, cls, level, intro, key)]
    for name, field in cls.model_fields.items():
        holds = nested(field)
        if holds is None:
            continue
        sub = child_path(path, name, holds.kind)
        doc = [_prose(field.description)] if field.description else []
        deeper = min(level + 1, 6)
        if holds.kind == "union":
            for variant in holds.classes:
                value = variant_name(variant, holds.key)
                label = f"{sub} ({holds.key}: {value})" if holds.key else f"{sub} ({value})"
                # The union's own docstring is in its parent's table; here what sets this variant apart.
                picked = [f"`{sub}` with `{holds.key}: {value}`."] if holds.key else []
                out += _blocks(variant, sub, deeper, label, picked + _class_doc(variant), holds.key)
        else:
            out += _blocks(holds.classes[0], sub, deeper, sub, doc + _class_doc(holds.classes[0]))
    return out


def _class_doc(cls: type) -> list[str]:
    own = cls.__dict__.get("__doc__")  # never an inherited one
    return [_prose(own)] if own else []


def _table(block: Block, anchors: dict[tuple[str, type], str]) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    fields = list(block.cls.model_fields.items())
    fields.sort(key=lambda item: item[0] != block.key)  # a variant's key first, the rest in their order
    for name, field in fields:
        holds = nested(field)
        path = f"{block.path}.{name}" if block.path else name
        if holds is None:
            kind = _code(type_text(field.annotation, list(field.metadata)))
        else:
            sub = child_path(block.path, name, holds.kind)
            links = []
            for variant in holds.classes:
                anchor = anchors[(sub, variant)]
                label = variant_name(variant, holds.key) if holds.kind == "union" else "section"
                links.append(f"[{label}](#{anchor})")
            prefix = {"union": "one of ", "list": "list of ", "dict": "dict of "}.get(holds.kind, "")
            kind = prefix + ", ".join(links)
        rows.append(f"| {_code(path)} | {_cell(kind)} | {_cell(default_text(field, holds))} | "
                    f"{_cell(_prose(field.description))} |")
    return rows


def render() -> str:
    """The whole reference, as the file should read."""
    blocks = _blocks(TetherConfig, "", 1, "Top level", [])
    blocks[0].level = 2
    blocks[0].intro = ["The fields outside any section, and the sections themselves."]
    anchors = {(b.path, b.cls): slug(b.title) for b in blocks}
    lines = [HEADER]
    for b in blocks:
        lines += [f"{'#' * max(b.level, 2)} {b.title}", ""]
        for paragraph in b.intro:
            lines += [paragraph, ""]
        lines += _table(b, anchors) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/reference/config.md from the config classes.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is out of date; write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.is_file() else None
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date with the config classes: run "
                  "python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

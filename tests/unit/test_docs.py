"""The docs stay true to the code: README.md and docs/ link only to what exists, the generated config
reference is current and names every field, and every `tether ...` command in their code blocks parses.

Commands run in-process and only as far as `--dry-run` (train, sft, eval, rollout) or the argument
parser (the rest): nothing here starts Ray, loads a model or trains.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from tether.cli import _parser, main
from tether.config import TetherConfig
from tether.config.base import Section

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONFIG_COMMANDS = ("train", "sft", "eval", "rollout")  # read a recipe; --dry-run validates it
OTHER_COMMANDS = ("report", "export", "serve", "import-gguf")  # parsed only: they act at once


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- markdown


FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")


def _split(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, list[tuple[int, str]]]]]:
    """(prose lines, code blocks) of a page, each line with its 1-based number; a code block with its
    info string ("bash", "" ...)."""
    prose, blocks = [], []
    block: list[tuple[int, str]] | None = None
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if block is None and match:
            fence, block = match.group(1), []
            blocks.append((match.group(2).lower(), block))
        elif block is not None and line.strip().startswith(fence[:3]) and line.strip().strip(fence[0]) == "":
            block = None
        elif block is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    return prose, blocks


def _without_code_spans(line: str) -> str:
    return re.sub(r"(`+).+?\1", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks reduced to their text, lower case, every
    character but letters, digits, spaces, '-' and '_' dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    prose, _ = _split(path.read_text())
    for _, line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links() -> list[tuple[str, Path, str]]:
    out = []
    for page in PAGES:
        prose, _ = _split(page.read_text())
        for number, line in prose:
            for target in LINK.findall(_without_code_spans(line)):
                out.append((f"{_rel(page)}:{number}", page, target))
    return out


LINKS = _links()


@pytest.mark.parametrize("where,page,target", LINKS, ids=[f"{w} {t}" for w, _, t in LINKS])
def test_relative_links_resolve(where, page, target):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not checked here
        return
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    assert dest.exists(), f"{where}: link to {target}: {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), (f"{where}: link to {target}: no heading with the anchor #{anchor} in "
                                         f"{_rel(dest)} (it has {sorted(anchors(dest))})")


# --------------------------------------------------------------------------- the config reference


def _generator() -> types.ModuleType:
    name = "gen_config_reference"
    if name not in sys.modules:  # its dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gen_config_reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_config_reference_is_current():
    gen = _generator()
    assert gen.OUT.is_file(), "docs/reference/config.md is missing: run python scripts/gen_config_reference.py"
    assert gen.OUT.read_text() == gen.render(), ("docs/reference/config.md is out of date with the config "
                                                 "classes: run python scripts/gen_config_reference.py")
    assert gen.main(["--check"]) == 0


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _sections(tp: Any, suffix: str = "") -> list[tuple[str, type]]:
    """The Section classes a field holds, each with the path step to reach one: "" for a section or a
    union variant, "[i]" for a list item, ".<key>" for a dict value."""
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return [s for arg in typing.get_args(tp) for s in _sections(arg, suffix)]
    if origin is list:
        return _sections(typing.get_args(tp)[0], suffix + "[i]")
    if origin is dict:
        return _sections(typing.get_args(tp)[1], suffix + ".<key>")
    if isinstance(tp, type) and issubclass(tp, Section):
        return [(suffix, tp)]
    return []


def config_paths(cls: type = TetherConfig, prefix: str = "") -> set[str]:
    """Every field's dotted path, into nested sections, list items and every variant of a union."""
    out = set()
    for name, field in cls.model_fields.items():
        path = prefix + name
        out.add(path)
        for suffix, sub in _sections(field.annotation):
            out |= config_paths(sub, f"{path}{suffix}.")
    return out


def test_config_reference_names_every_field():
    text = (ROOT / "docs" / "reference" / "config.md").read_text()
    paths = config_paths()
    assert "rollout.temperature" in paths and "eval.datasets[i].reasoning_gym.per_task" in paths
    missing = sorted(p for p in paths if f"`{p}`" not in text)
    assert not missing, f"fields missing from docs/reference/config.md: {missing}"


# --------------------------------------------------------------------------- commands in code blocks


def _command_substitutions(line: str) -> str:
    """$(...) replaced by a plain word, nested parentheses and quotes included, so shlex sees one token."""
    out, i = [], 0
    while i < len(line):
        if line.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(line):
                depth += {"(": 1, ")": -1}.get(line[j], 0)
                if depth == 0:
                    break
                j += 1
            out.append("SUBSTITUTED")
            i = j + 1
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _shell_lines() -> list[tuple[str, list[str]]]:
    """(file:line, argv without leading VAR=value words) of every command in a shell or plain code
    block, continuation lines joined."""
    out = []
    for page in PAGES:
        _, blocks = _split(page.read_text())
        for info, lines in blocks:
            if info not in ("bash", "sh", "shell", "console", ""):
                continue
            pending, start = "", 0
            for number, line in lines:
                if not pending:
                    start = number
                pending += line.rstrip()
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                    continue
                text, pending = _command_substitutions(pending.strip()), ""
                # Output shown in a plain block (error messages, tables) is not a command; only lines
                # that start with a known program are split as shell words.
                if not re.match(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(tether|bash|python)\s", text):
                    continue
                argv = shlex.split(text, comments=True)
                while argv and ENV.match(argv[0]):
                    argv.pop(0)
                out.append((f"{_rel(page)}:{start}", argv))
    return out


SHELL_LINES = _shell_lines()
TETHER_LINES = [(where, argv[1:]) for where, argv in SHELL_LINES if argv and argv[0] == "tether"]


def _check_value(tp: Any, parts: list[str], done: list[str]) -> str | None:
    """None when ``parts`` name something inside a value of type ``tp``, else why not."""
    if not parts:
        return None
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = [_check_value(arg, parts, done) for arg in typing.get_args(tp) if arg is not type(None)]
        return None if any(e is None for e in errors) else errors[0]
    if origin is list:
        if not parts[0].isdigit():
            return f"{'.'.join(done)} is a list: {parts[0]!r} is not an index"
        return _check_value(typing.get_args(tp)[0], parts[1:], done + [parts[0]])
    if origin is dict:
        return _check_value(typing.get_args(tp)[1], parts[1:], done + [parts[0]])
    if tp is Any:
        return None
    if isinstance(tp, type) and issubclass(tp, Section):
        return _check_fields([tp], parts, done)
    return f"{'.'.join(done)} is a value, not a section"


def _check_fields(classes: list[type], parts: list[str], done: list[str]) -> str | None:
    name = parts[0]
    fields = [c.model_fields[name] for c in classes if name in c.model_fields]
    if not fields:
        return f"{'.'.join(done + [name])}: no such config field"
    errors = [_check_value(f.annotation, parts[1:], done + [name]) for f in fields]
    return None if any(e is None for e in errors) else errors[0]


def override_error(override: str) -> str | None:
    """Why a ``section.field=value`` override names no config field (a union's variants all count)."""
    key = override.split("=", 1)[0].strip()
    return _check_fields([TetherConfig], key.split("."), [])


def _parse(argv: list[str]) -> Any:
    """The CLI's own parse, late overrides included (as main() does); SystemExit on a bad command line."""
    args, extra = _parser().parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if late and hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + late
        extra = [a for a in extra if a not in late]
    assert not extra, f"unrecognized arguments: {extra}"
    return args


def test_code_blocks_hold_tether_commands():
    assert len(TETHER_LINES) >= 20, TETHER_LINES  # the extraction itself works
    assert {argv[0] for _, argv in TETHER_LINES} >= {*CONFIG_COMMANDS, *OTHER_COMMANDS}


@pytest.mark.parametrize("where,argv", TETHER_LINES, ids=[w for w, _ in TETHER_LINES])
def test_tether_command_parses(where, argv, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes are named relative to the repository root
    shown = "tether " + " ".join(argv)
    assert argv and argv[0] in (*CONFIG_COMMANDS, *OTHER_COMMANDS), f"{where}: unknown command: {shown}"
    try:
        args = _parse(argv)
    except SystemExit as err:
        pytest.fail(f"{where}: the CLI does not accept {shown} (exit {err.code})")
    if argv[0] not in CONFIG_COMMANDS:
        return
    config = getattr(args, "config", None)
    if config and "$" not in config and (ROOT / config).is_file():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, "--dry-run"])
        assert code == 0, f"{where}: {shown} --dry-run exited {code}:\n{err.getvalue()}"
    else:  # a recipe of the reader's own (or a run directory's): the overrides must still name fields
        bad = [e for e in map(override_error, args.overrides) if e]
        assert not bad, f"{where}: {shown}: {bad}"


SCRIPT_LINES = [(where, argv) for where, argv in SHELL_LINES if argv and argv[0] in ("bash", "python")]


@pytest.mark.parametrize("where,argv", SCRIPT_LINES, ids=[w for w, _ in SCRIPT_LINES])
def test_scripts_in_code_blocks_exist_and_take_real_overrides(where, argv):
    if len(argv) < 2 or argv[1].startswith("-"):  # python -m / -c
        return
    assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
    # Scripts pass section.field=value words on to tether (recipes' run.sh, bench/*.py).
    dotted = [a.split("=", 1)[0] for a in argv[2:] if re.match(r"^[a-z_]+(\.[a-z0-9_]+)+=", a)]
    bad = [e for e in (override_error(k + "=") for k in dotted) if e]
    assert not bad, f"{where}: {' '.join(argv)}: {bad}"


def test_override_check_knows_unions_lists_and_typos():
    assert override_error("rollout.temperature=0.8") is None
    assert override_error("eval.datasets.0.path=x.jsonl") is None
    assert override_error("data.reasoning_gym.settings.chain_sum.min_terms=2") is None
    assert "no such config field" in override_error("rollout.temprature=0.8")
    assert "is a value" in override_error("seed.value=1")
    assert "not an index" in override_error("eval.datasets.first.path=x")


def test_slugs_follow_github():
    assert slug("Against TRL's GRPOTrainer") == "against-trls-grpotrainer"
    assert slug("rollout.schedule (mode: fully_async)") == "rolloutschedule-mode-fully_async"
    assert slug("External engines and `tether serve`") == "external-engines-and-tether-serve"

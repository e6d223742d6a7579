"""MkDocs hook: the configuration reference, generated from the code at every build.

Each documented class is imported, and its fields (a dataclass) or ``__init__`` parameters
are read with their type and default; the words come from the code too, so nothing is
typed twice:

- a dataclass field's documentation is its attribute docstring (a string literal right
  after the field); a field without one falls back to its comments (a trailing comment,
  or the comment lines directly above it);
- an ``__init__`` parameter's documentation is its entry in an ``Args:`` section of the
  class or ``__init__`` docstring, else the class docstring's sentences that name it.

Deprecated aliases (``InitVar`` fields, or the keys of a ``*DEPRECATED*`` / ``*ALIAS*``
mapping on the class or in its module) are listed apart, with their replacement.

The page is added to the build as ``reference/configuration.md``; nothing is written into
``docs/``. ``python docs/hooks/config_reference.py`` prints it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = "reference/configuration.md"


@dataclass(frozen=True)
class Section:
    target: str  # "module:qualname"
    where: str  # where the values go, for a reader of YAML and of Python


SECTIONS = (
    Section("lightning_logra.core.config:LoGRAConfig",
            "YAML `trainer.strategy.init_args.logra`; Python `LoGRAFSDPStrategy(logra=LoGRAConfig(...))`, "
            "`LoGRAFabricStrategy(logra=...)` or `LoGRAOptimizer(model, LoGRAConfig(...))`"),
    Section("lightning_logra.strategies.trainer:LoGRAFSDPStrategy",
            "YAML `trainer.strategy` (`class_path: lightning_logra.LoGRAFSDPStrategy`, `init_args`); "
            "Python `L.Trainer(strategy=LoGRAFSDPStrategy(...))`"),
    Section("lightning_logra.strategies.fabric:LoGRAFabricStrategy",
            "Python `L.Fabric(strategy=LoGRAFabricStrategy(...))`"),
    Section("lightning_logra.callbacks.logra:LoGRACallback",
            "YAML `trainer.callbacks` (`class_path: lightning_logra.LoGRACallback`); Python `callbacks=[LoGRACallback(...)]`"),
    Section("lightning_logra.modules.grpo:GRPOModule",
            "YAML `model.init_args` (`class_path: lightning_logra.modules.GRPOModule`); Python `GRPOModule(...)`"),
    Section("lightning_logra.rl.config:LossConfig", "YAML `model.init_args.loss`; Python `GRPOModule(loss=LossConfig(...))`"),
    Section("lightning_logra.rollout.config:RolloutConfig",
            "YAML `model.init_args.rollout`; Python `GRPOModule(rollout=RolloutConfig(...))`"),
    Section("lightning_logra.rl.config:OptimizerConfig",
            "YAML `model.init_args.optimizer`; Python `GRPOModule(optimizer=OptimizerConfig(...))`"),
    Section("lightning_logra.rewards.config:RewardConfig",
            "YAML `model.init_args.reward`; Python `GRPOModule(reward=RewardConfig(...))`"),
    Section("lightning_logra.rollout.judge:JudgeReward",
            "YAML an entry of `model.init_args.reward.functions` with `class_path` and `init_args`; Python "
            "`RewardConfig(functions=[JudgeReward(...)])`"),
    Section("lightning_logra.rl.config:BatchingConfig",
            "YAML `model.init_args.batching`; Python `GRPOModule(batching=BatchingConfig(...))`"),
    Section("lightning_logra.rl.config:LoggingConfig",
            "YAML `model.init_args.logging`; Python `GRPOModule(logging=LoggingConfig(...))`"),
    Section("lightning_logra.rl.config:MultiTurnConfig",
            "YAML `model.init_args.multi_turn`; Python `GRPOModule(multi_turn=MultiTurnConfig(...))` (with `tools` "
            "or `environment_factory`)"),
    Section("lightning_logra.rl.config:LoRAConfig",
            "YAML `model.init_args.lora` (setting it trains LoRA adapters); Python `GRPOModule(lora=LoRAConfig(...))`"),
    Section("lightning_logra.data.datamodule:PromptDataModule",
            "YAML `data.init_args` (`class_path: lightning_logra.data.PromptDataModule`); Python `PromptDataModule(...)`"),
    Section("lightning_logra.modules.sft:SFTModule",
            "YAML `model.init_args` (`class_path: lightning_logra.modules.SFTModule`); Python `SFTModule(...)`; "
            "`optimizer` and `lora` take the `OptimizerConfig` and `LoRAConfig` above"),
    Section("lightning_logra.data.conversations:ConversationDataModule",
            "YAML `data.init_args` (`class_path: lightning_logra.data.ConversationDataModule`); Python "
            "`ConversationDataModule(...)`"),
)

INTRO = """\
# Configuration reference

Every setting, generated from the code when the site is built: the fields of the
configuration dataclasses and the arguments of the classes a YAML config names, each with
its type, default and the documentation written beside it in the source. The same names
work in YAML (`logra fit -c config.yaml`), on the command line
(`--trainer.strategy.init_args.logra.rank=64`) and in Python.
Invalid values fail at construction, naming the field and what it accepts.

The command line shows the same documentation: each field's docstring is its help text,
e.g. for `LoGRAConfig`:

```bash
logra fit --trainer.strategy.help=lightning_logra.LoGRAFSDPStrategy --trainer.strategy.logra.help
```

Renamed fields keep their old names as deprecated aliases, listed under their class's
table: they still work as YAML keys and keyword arguments, and warn once.

"""


# ----------------------------------------------------------------------------- reading the code
def load(target: str) -> type:
    module, _, name = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _class_node(cls: type) -> tuple[ast.ClassDef, str] | None:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return (node, source) if isinstance(node, ast.ClassDef) else None


def _comments(source: str) -> dict[int, tuple[bool, str]]:
    """Line -> (whole-line comment?, text) for every comment in ``source``."""
    lines = source.splitlines()
    found: dict[int, tuple[bool, str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            whole = not lines[row - 1][:column].strip()
            found[row] = (whole, token.string.lstrip("#").strip())
    return found


def field_docs(cls: type) -> dict[str, str]:
    """Documentation of each field assigned in ``cls``'s body (base classes first)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        parsed = _class_node(klass) if dataclasses.is_dataclass(klass) else None
        if parsed is None:
            continue
        node, source = parsed
        comments = _comments(source)
        body = node.body
        for index, statement in enumerate(body):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            following = body[index + 1] if index + 1 < len(body) else None
            if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
                continue
            above: list[str] = []
            row = statement.lineno - 1
            while row in comments and comments[row][0]:
                above.insert(0, comments[row][1])
                row -= 1
            trailing = [comments[row][1] for row in range(statement.lineno, statement.end_lineno + 1)
                        if row in comments and not comments[row][0]]
            docs[statement.target.id] = " ".join(above + trailing)
    return docs


def deprecated_aliases(cls: type) -> dict[str, Any]:
    """Old name -> what replaces it, from any ``*DEPRECATED*`` / ``*ALIAS*`` mapping on the
    class or in its module (a mapping keyed by class name is looked into)."""
    found: dict[str, Any] = {}
    module = sys.modules.get(cls.__module__)
    for owner in (module, cls):
        for name, value in vars(owner).items() if owner is not None else ():
            if not isinstance(value, Mapping) or not re.search("DEPRECAT|ALIAS", name, re.IGNORECASE):
                continue
            if cls.__name__ in value and isinstance(value[cls.__name__], Mapping):
                value = value[cls.__name__]
            elif owner is module and not _names_fields_of(value, cls):
                continue  # a module-level mapping for another class
            found.update({str(key): replacement for key, replacement in value.items()})
    return found


def _names_fields_of(mapping: Mapping, cls: type) -> bool:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= set(inspect.signature(cls).parameters)
    targets = {v if isinstance(v, str) else (v[0] if isinstance(v, (tuple, list)) and v else None) for v in mapping.values()}
    return bool(targets & names) or bool(set(map(str, mapping)) & names)


def args_section(docstring: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Args:`` / ``Parameters:`` section."""
    entries: dict[str, str] = {}
    match = re.search(r"^(Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)+)", docstring, re.MULTILINE)
    if not match:
        return entries
    current = None
    for line in textwrap.dedent(match.group(2)).splitlines():
        item = re.match(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if item:
            current = item.group(1)
            entries[current] = item.group(2)
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


_SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z`(\"'])")


def sentences_naming(docstring: str, name: str) -> str:
    """The sentences of ``docstring`` that name ``name`` as code (````name````)."""
    pattern = re.compile(r"``" + re.escape(name) + r"(?:``|[=\[(])")
    picked = []
    for paragraph in re.split(r"\n\s*\n", docstring):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if pattern.search(sentence):
                picked.append(sentence)
    return " ".join(picked)


# ----------------------------------------------------------------------------- writing markdown
def _code_spans(text: str) -> str:
    """reST-style double backticks to markdown code spans (a span broken across lines is
    joined: without a space after a dot, as in a wrapped dotted name)."""
    def span(match: re.Match) -> str:
        inner = re.sub(r"(?<=\.)\s*\n\s*", "", match.group(1))
        return "`" + re.sub(r"\s*\n\s*", " ", inner) + "`"
    return re.sub(r"``(.+?)``", span, text, flags=re.DOTALL)


def _markdown(text: str) -> str:
    """Documentation text as markdown on one line (for a table cell)."""
    text = _code_spans(text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "<br><br>".join(paragraphs)


def _cell(text: str) -> str:
    """Escape the pipes that would split a table cell: those outside code spans (inside
    one, Python-Markdown's tables keep a pipe, and would show a backslash)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _type_name(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\btyping\.", "", repr(annotation))


def _default(value: Any) -> str:
    if value is dataclasses.MISSING or value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, type):
        return value.__name__
    return repr(value)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _class_docs(cls: type) -> str:
    return _code_spans(inspect.getdoc(cls) or "")


def _linked_type(annotation: str, documented: dict[str, type]) -> str:
    """The type in code, followed by links to the documented classes it names."""
    links = [f"[{name}](#{_anchor(cls)})" for name, cls in documented.items() if re.search(rf"\b{name}\b", annotation)]
    return _code(annotation) + ("<br>" + ", ".join(links) if links else "")


def dataclass_rows(cls: type, documented: dict[str, type]) -> tuple[list[str], list[str]]:
    """Table rows of the fields, and of the deprecated aliases apart."""
    docs = field_docs(cls)
    aliases = deprecated_aliases(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in aliases:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        rows.append(f"| `{f.name}` | {_cell(_linked_type(_type_name(f.type), documented))} | "
                    f"{_cell(_code(_default(default)))} | {_cell(_markdown(docs.get(f.name, '')))} |")
    # InitVar pseudo-fields (dataclasses.fields() leaves them out) are deprecated keyword names.
    init_vars = [name for name, f in cls.__dataclass_fields__.items() if "InitVar" in _type_name(f.type)]
    deprecated = [_deprecated_row(name, aliases.get(name), docs.get(name, ""))
                  for name in dict.fromkeys([*aliases, *init_vars])]
    return rows, deprecated


def _deprecated_row(name: str, replacement: Any, doc: str) -> str:
    if isinstance(replacement, (tuple, list)) and replacement:
        replacement = replacement[0]
    instead = f"`{replacement}`" if isinstance(replacement, str) else ""
    # "Deprecated: use ``x``." says no more than the table does.
    note = re.sub(r"^\s*Deprecated[:.]?\s*(use\s+``?[\w.]+``?\.?)?\s*", "", doc, flags=re.IGNORECASE)
    return f"| `{name}` | {instead} | {_cell(_markdown(note))} |"


def signature_rows(cls: type, documented: dict[str, type]) -> tuple[list[str], list[str]]:
    """Table rows of the ``__init__`` parameters, and of the deprecated aliases apart."""
    class_doc = inspect.getdoc(cls) or ""
    init_doc = inspect.getdoc(cls.__init__) if "__init__" in vars(cls) else ""
    from_args = {**args_section(class_doc), **args_section(init_doc or "")}
    aliases = deprecated_aliases(cls)
    rows, deprecated = [], []
    first_with: dict[str, str] = {}  # documentation -> the first parameter it was shown for
    for name, parameter in inspect.signature(cls).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        doc = from_args.get(name) or sentences_naming(class_doc, name)
        if name in aliases:
            deprecated.append(_deprecated_row(name, aliases[name], from_args.get(name, "")))
            continue
        if doc and doc in first_with:
            doc = f"See ``{first_with[doc]}``."
        elif doc:
            first_with[doc] = name
        rows.append(f"| `{name}` | {_cell(_linked_type(_type_name(parameter.annotation), documented))} | "
                    f"{_cell(_code(_default(parameter.default)))} | {_cell(_markdown(doc))} |")
    return rows, deprecated


def render(sections: tuple[Section, ...] = SECTIONS) -> str:
    classes = [(section, load(section.target)) for section in sections]
    documented = {cls.__name__: cls for _, cls in classes}
    out = [INTRO]
    for section, cls in classes:
        out.append(f"## `{cls.__name__}` {{#{_anchor(cls)}}}\n")
        out.append(f"`{cls.__module__}.{cls.__qualname__}`: {section.where}.\n")
        doc = _class_docs(cls)
        if doc:
            out.append(doc + "\n")
        if dataclasses.is_dataclass(cls):
            rows, deprecated = dataclass_rows(cls, documented)
        else:
            rows, deprecated = signature_rows(cls, documented)
        out.append("| name | type | default | what it does |\n|---|---|---|---|")
        out.extend(rows)
        out.append("")
        if deprecated:
            out.append("Deprecated names (still accepted, with a warning):\n")
            out.append("| deprecated name | use instead | note |\n|---|---|---|")
            out.extend(deprecated)
            out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the MkDocs hook
def on_files(files, config):
    from mkdocs.structure.files import File

    # Document the checkout being built, even where another copy of the package is installed.
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    existing = files.get_file_from_path(PAGE)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(render())

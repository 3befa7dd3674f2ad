"""The knob reference, ``docs/knobs.md``, generated from the feature configs' fields: each knob's ``Literal`` type,
default and docstring are written once, there. Run ``python -m titan_strategy.knob_reference > docs/knobs.md``;
a test fails when the file is stale."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from titan_strategy.config import TitanConfig, knob_fields
from titan_strategy.knobs import KNOB, choices

__all__ = ["field_docstrings", "knob_reference"]

_HEADER = """# Knob reference

Every argument of `TitanStrategy(...)`, which is also the YAML of `trainer.strategy.init_args` under `titan fit`.
Generated from the fields of `titan_strategy/config/` by `python -m titan_strategy.knob_reference > docs/knobs.md`:
edit a field's docstring there, not this file.

```yaml
trainer:
  strategy:
    class_path: titan_strategy.TitanStrategy
    init_args:
      data_parallel_shard_size: -1
      tensor_parallel_size: 2
      activation_checkpointing: selective_op
```
"""
_TITLES = {"fsdp": "FSDP", "cuda_graphs": "CUDA graphs"}


def field_docstrings(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass, as its docstring (Python keeps none at runtime)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(after.value.value.split())  # type: ignore[union-attr]
    return docs


def _type_text(hint: Any) -> str:
    allowed = choices(hint)
    if allowed:
        text = " \\| ".join(f"`{value!r}`" for value in allowed)
        return f"{text} \\| `None`" if type(None) in typing.get_args(hint) else text
    return f"`{inspect.formatannotation(hint)}`"


def knob_reference() -> str:
    """The markdown of ``docs/knobs.md``: one table per feature, in ``TitanConfig``'s order."""
    sections = [_HEADER]
    for feature_field in dataclasses.fields(TitanConfig):
        feature = typing.get_type_hints(TitanConfig)[feature_field.name]
        hints, docs = typing.get_type_hints(feature), field_docstrings(feature)
        rows = ["| knob | values | default | what it does |", "|---|---|---|---|"]
        for field in knob_fields(feature):
            description = docs[field.name].replace("|", "\\|")
            rows.append(f"| `{field.metadata[KNOB]}` | {_type_text(hints[field.name])} | `{field.default!r}` | "
                        f"{description} |")
        summary = " ".join(inspect.getdoc(feature).split())
        title = _TITLES.get(feature_field.name, feature_field.name.replace("_", " ").capitalize())
        sections.append(f"## {title} (`{feature.__name__}`)\n\n"
                        f"{summary}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


if __name__ == "__main__":
    print(knob_reference(), end="")

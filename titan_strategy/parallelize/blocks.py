"""The repeated blocks of a module that declares none: what FSDP wraps, checkpointing recomputes and compile
compiles one by one."""

from __future__ import annotations

from torch import nn

__all__ = ["repeated_blocks"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def repeated_blocks(module: nn.Module) -> tuple[str, ...]:
    """The names of the module's repeated blocks, outermost first found, in module order: the classes a
    transformers model names in ``_no_split_modules`` (its decoder layers), and the children of a ``ModuleList``,
    ``ModuleDict`` or ``Sequential`` that are two or more of one class holding parameters. A block's own
    submodules are never blocks too."""
    no_split = {name for m in module.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    blocks: list[str] = []

    def inside_a_block(name: str) -> bool:
        return any(name == block or name.startswith(block + ".") for block in blocks)

    for name, submodule in module.named_modules():
        if not name or inside_a_block(name):
            continue
        if type(submodule).__name__ in no_split:
            blocks.append(name)
        elif isinstance(submodule, _CONTAINERS):
            children = list(submodule.named_children())
            if len(children) > 1 and len({type(c) for _, c in children}) == 1 and _holds_parameters(children[0][1]):
                blocks.extend(f"{name}.{child}" for child, _ in children)
    return tuple(blocks)

"""The kernel registry: every ``KernelSpec`` by name."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from . import control, elementwise, layout, linalg, rows
from .spec import KernelSpec


class UnknownKernel(KeyError):
    """No kernel of that name; the message lists the valid names."""

    def __init__(self, name: object, valid: list[str]):
        self.name = name
        self.valid = valid
        super().__init__(f"unknown kernel {name!r}; valid kernels: {', '.join(valid)}")

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0])


def _registry() -> Mapping[str, KernelSpec]:
    table: dict[str, KernelSpec] = {}
    for spec in (*elementwise.SPECS, *linalg.SPECS, *rows.SPECS, *control.SPECS,
                 *layout.SPECS):
        # The entry naming rule lets a profiler trace be read without this table.
        if spec.name in table or spec.entry != f"sl_{spec.name}":
            raise RuntimeError(f"kernel {spec.name!r} is registered twice or its entry "
                               f"{spec.entry!r} is not 'sl_{spec.name}'")
        table[spec.name] = spec
    return MappingProxyType(table)


KERNELS: Mapping[str, KernelSpec] = _registry()


def get_kernel(name: str) -> KernelSpec:
    """The spec named ``name``; raises ``UnknownKernel`` (a ``KeyError``) listing valid names."""
    try:
        return KERNELS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name from an untrusted manifest
        raise UnknownKernel(name, kernel_names()) from None


def kernel_names(in_programs_only: bool = False) -> list[str]:
    """Sorted kernel names; ``in_programs_only`` leaves out kernels programs cannot use."""
    return sorted(n for n, s in KERNELS.items() if s.in_programs or not in_programs_only)

"""A small numpy interpreter of the NKI subset used by the GDN kernels, and the backend switch.

Kernel modules are written once against the names ``nki``, ``nl`` (``nki.language``) and ``nisa``
(``nki.isa``) obtained from :func:`nki_modules`. With the AWS Neuron ``nki`` package importable, those are
the real modules (run kernels on CPU with ``nki.simulate(kernel)(...)``); otherwise they are this
interpreter, whose ``nki.simulate`` runs the kernel eagerly in numpy. Set
``OPTIMUM_QWEN36_NKI_INTERPRETER=1`` to force the interpreter.

The interpreter checks the documented operand rules and capacity limits and raises
:class:`NkiLimitError` on a violation and :class:`NkiUnsupportedError` on anything it does not model.
It proves functional correctness of the tiling only; see docs/NKI.md for what it does not prove.
"""

from __future__ import annotations

import os
from types import ModuleType

from optimum_qwen36.nki.interpreter import isa, language, runtime
from optimum_qwen36.nki.interpreter.tensor import NkiInterpreterError, NkiLimitError, NkiUnsupportedError

__all__ = [
    "NkiInterpreterError",
    "NkiLimitError",
    "NkiUnsupportedError",
    "isa",
    "language",
    "nki_modules",
    "real_nki_available",
    "runtime",
]


def _import_real_nki() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    # PyPI's "nki" is a placeholder that raises on import: any failure means "not available".
    try:
        import nki
        import nki.isa as nisa
        import nki.language as nl
    except Exception:
        return None
    if not all(hasattr(nki, name) for name in ("jit", "simulate")):
        return None
    return nki, nl, nisa


def real_nki_available() -> bool:
    """True when the AWS Neuron ``nki`` package imports (and the interpreter is not forced)."""
    return os.environ.get("OPTIMUM_QWEN36_NKI_INTERPRETER") != "1" and _import_real_nki() is not None


def nki_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(nki, nki.language, nki.isa): the real modules when available, else this interpreter's."""
    real = _import_real_nki() if os.environ.get("OPTIMUM_QWEN36_NKI_INTERPRETER") != "1" else None
    return real if real is not None else (runtime, language, isa)

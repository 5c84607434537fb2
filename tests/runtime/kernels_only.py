"""A prelude for the scripts that the kernel tests run in fresh Python processes and that use nothing of the
runtime but runtime/kernels/library.py (which imports only the standard library): it registers the `runtime`
package without running its __init__, which imports the engine and with it torch (~3 CPU-seconds a process).
What load() does in such a process is what it does in the engine's: the engine is not what these scripts
check (test_native_fallback.py starts the engine once, with everything imported)."""

from __future__ import annotations

from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

PRELUDE = f"""
import sys as _sys, types as _types
_package = _types.ModuleType("runtime")
_package.__path__ = [{str(RUNTIME)!r}]
_sys.modules["runtime"] = _package
"""


def command(script: str, *args: str) -> list[str]:
    """The arguments of a Python process that runs the prelude, then `script` with sys.argv[1:] = args."""
    import sys

    return [sys.executable, "-c", PRELUDE + script, *args]


def module_command(module: str, *args: str) -> list[str]:
    """As `python -m module args`, after the prelude."""
    script = f"import runpy\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return command(script, *args)

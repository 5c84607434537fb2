"""Every function the kernel library exports is declared once in csrc/kernels.h, and the ctypes signatures
native_kernels gives them match those declarations (a mismatch would pass wrong arguments silently)."""

from __future__ import annotations

import ctypes
import re
import subprocess

from runtime.kernels import library as native_kernels

POINTER = ctypes.c_void_p
SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double}


def declarations() -> dict[str, tuple[type | None, list[type]]]:
    """kernels.h's prototypes as ctypes types: any pointer a void pointer, `void` as no result."""
    text = re.sub(r"/\*.*?\*/", "", (native_kernels.CSRC / "kernels.h").read_text(), flags=re.S)
    found = {}
    for ret, name, args in re.findall(r"^(\w+)\s+(\w+)\(([^;]*?)\);", text, flags=re.M | re.S):
        params = [] if args.strip() == "void" else [" ".join(a.split()) for a in args.split(",")]
        argtypes = [POINTER if "*" in p else SCALARS[p.split()[-2]] for p in params]
        found[name] = (None if ret == "void" else SCALARS[ret], argtypes)
    return found


def test_each_ctypes_signature_matches_its_declaration():
    declared = declarations()
    assert set(declared) == set(native_kernels.SIGNATURES)
    for name, (restype, argtypes) in native_kernels.SIGNATURES.items():
        assert declared[name] == (restype, argtypes), name


def test_every_exported_function_is_declared():
    """The library's exported functions (nm) at each level this CPU runs are exactly kernels.h's."""
    for level in native_kernels.cpu_levels():
        lib = native_kernels.load_level(level.name)
        symbols = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True)
        assert symbols.returncode == 0, symbols.stderr
        exported = {line.split()[-1] for line in symbols.stdout.splitlines() if line.split()[1] == "T"}
        assert exported - {"_init", "_fini"} == set(declarations()), level.name

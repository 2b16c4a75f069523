"""Reading the SASS of a compiled kernel with ``nvdisasm`` (from the ``nvidia-cuda-nvdisasm`` wheel or PATH).

Used by the compile-only tests to confirm, without a GPU, that the tensor-core instructions we meant
are there (``HMMA`` on the FA2 path; ``HGMMA``, ``UTMALDG``, ``USETMAXREG`` on Hopper) and that nothing
spilled to local memory (``LDL``/``STL``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

OPCODES = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "UTMASTG", "USETMAXREG", "SYNCS", "STSM", "LDL", "STL")


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for site in map(Path, sys.path):
        for candidate in sorted(site.glob("nvidia/*/bin/nvdisasm")) + sorted(site.glob("nvidia/cuda_nvdisasm/bin/nvdisasm")):
            if candidate.is_file():
                return str(candidate)
    return None


def disassemble(cubin: Path, nvdisasm: str) -> str:
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def opcode_counts(sass: str) -> dict[str, int]:
    """How many instructions of each opcode family in ``OPCODES`` (``HMMA.16816.F32.BF16`` counts as HMMA)."""
    counts = dict.fromkeys(OPCODES, 0)
    for match in re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.MULTILINE):
        opcode = match.group(1)
        if opcode in counts:
            counts[opcode] += 1
    return counts

"""Reading the SASS of a compiled kernel with ``nvdisasm`` (from the ``nvidia-cuda-nvdisasm`` wheel or PATH).

Used by the compile-only tests to confirm, without a GPU, that the tensor-core instructions we meant
are there (``HMMA`` on the FA2 path; ``HGMMA`` (``QGMMA`` for e4m3), ``UTMALDG``, ``USETMAXREG`` on Hopper) and that nothing
spilled to local memory (``LDL``/``STL``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

OPCODES = (
    "HMMA", "HGMMA", "QGMMA", "LDSM", "LDGSTS", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKRED", "USETMAXREG", "SYNCS", "STSM",
    "LDL", "STL",
)
# Opcodes with a modifier counted apart as well (also counted under their opcode).
MODIFIED_OPCODES = ("UTMALDG.MULTICAST",)
HGMMA_GROUP_ENDS = "HGMMA.gsb0"


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
    """How many instructions of each opcode family in ``OPCODES`` (``HMMA.16816.F32.BF16`` counts as HMMA)
    and of each ``MODIFIED_OPCODES`` entry (``UTMALDG.4D.MULTICAST`` counts as UTMALDG.MULTICAST too)."""
    counts = dict.fromkeys(OPCODES + MODIFIED_OPCODES, 0)
    for match in re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)", sass, re.MULTILINE):
        opcode, modifiers = match.group(1), match.group(2).split(".")
        if opcode in counts:
            counts[opcode] += 1
        for name in MODIFIED_OPCODES:
            base, modifier = name.split(".")
            if opcode == base and modifier in modifiers:
                counts[name] += 1
    # WGMMAs that close a scoreboard group (``gsb0``): one per GEMM when ptxas keeps a GEMM's k-steps in
    # flight together, one per HGMMA when it serializes them (each then waits for the previous one).
    counts[HGMMA_GROUP_ENDS] = len(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?HGMMA\.[^;]*\bgsb0\b", sass,
                                              re.MULTILINE))
    return counts

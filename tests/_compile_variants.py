"""Compiles every kernel variant for one target arch with fake tensors and reads its SASS.

Run by test_compile_only in a fresh process (the DSL's target arch is fixed per process):
    python -m tests._compile_variants sm_80 OUT.json DUMP_DIR
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ["CUTE_DSL_ARCH"] = sys.argv[1]

from flashattn_hopper import dispatch, sass  # noqa: E402

from ._variant_keys import variant_keys  # noqa: E402


def main() -> None:
    arch, out_json, dump_root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    nvdisasm = sass.find_nvdisasm()
    results = []
    families = [f for backend in dispatch.BACKENDS_FOR_TARGET[arch] for f in dispatch.families(backend)]
    for spec in families:
        for key in variant_keys(spec, arch):
            # (a full key name can pass the 255 bytes a file name may have: its head and a digest then)
            digest = hashlib.sha256(key.name.encode()).hexdigest()[:16]
            name = key.name if len(key.name) <= 200 else f"{key.name[:180]}-{digest}"
            dump_dir = dump_root / name
            dump_dir.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            row = {"kernel": key.name, "head_dim": getattr(key, "head_dim", 0), "error": None, "counts": None}
            try:
                spec.compile(key, options=f"--keep-cubin --dump-dir {dump_dir}")
                row["seconds"] = time.perf_counter() - start
                cubins = sorted(dump_dir.glob("*.cubin"))
                if nvdisasm and cubins:
                    row["counts"] = sass.opcode_counts(sass.disassemble(cubins[0], nvdisasm))
            except Exception as e:  # reported per variant by the test
                row["error"] = f"{type(e).__name__}: {e}"[-4000:]
            results.append(row)
            print(json.dumps(row), flush=True)
    out_json.write_text(json.dumps({"nvdisasm": nvdisasm, "results": results}, indent=1))


if __name__ == "__main__":
    main()

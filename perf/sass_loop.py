"""Instruction mix of a kernel's main loop per iteration, read off its SASS (not a test; no GPU needed).

    CUTE_DSL_ARCH=sm_90a python perf/sass_loop.py KEY_SUBSTRING [--kind bwd_sm90]
    python perf/sass_loop.py --sass FILE.sass

Compiles the first kernel key of the backward and forward families (``all_keys`` of the target arch)
whose name contains ``KEY_SUBSTRING`` (``--kind`` narrows the kernel kind), disassembles its cubin
(``flashattn_hopper.sass``), or reads a SASS listing. The main loop is the backward branch enclosing
the most HGMMAs. The loop is walked along its steady-state path: every mbarrier try-wait succeeds at
once (its retry block skipped), and a two-predicate branch inside the loop (the mask's
``@P BRA !P``) taken or not, so a kernel that branches around its mask shows two columns. Prints the
count per instruction class along each path, the order of HGMMA groups, waits, barriers and exp2
runs, how many ``MUFU.EX2`` sit before and after the wait for the second GEMM group (the backward's
dP^T), and the kernel's LDL/STL. Session 25 (perf/NOTES.md) compared our hdim-64 backward loop with
FA4's this way (FA4's cubin compiled from its wheel's sources on the CPU, with its own fake tensors).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile
from pathlib import Path

_INT_OPS = {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "VIADD", "VIADDMNMX", "VIMNMX", "SEL", "IABS",
            "IMNMX", "PLOP3", "P2R", "R2P", "POPC", "FLO", "BMSK", "SGXT", "PRMT", "IADD", "SHL", "SHR"}
_CLASSES = (  # (class, opcode prefixes), first match wins
    ("HGMMA", ("HGMMA",)), ("MUFU.EX2", ("MUFU.EX2",)), ("MUFU other", ("MUFU",)),
    ("FFMA/FMUL/FADD/FMNMX", ("FFMA", "FMUL", "FADD", "FMNMX")), ("FSEL", ("FSEL",)),
    ("F2FP/cvt", ("F2FP", "F2F", "I2F", "F2I")), ("LDS/LDSM", ("LDS",)), ("STS/STSM", ("STS",)),
    ("BAR/SYNCS/fence", ("BAR", "SYNCS", "MEMBAR", "FENCE", "CCTL")), ("WARPGROUP", ("WARPGROUP",)),
    ("SHFL", ("SHFL",)), ("global/TMA/bulk", ("LDG", "STG", "RED", "ATOM", "UBLKRED", "UBLKCP", "UTMA", "DEPBAR")),
    ("LDL/STL", ("LDL", "STL")), ("BRA", ("BRA",)), ("uniform", ("U", "R2UR", "S2UR")),
)


def instruction_class(op: str) -> str:
    for name, prefixes in _CLASSES:
        if op.startswith(prefixes):
            return name
    return "int/addr" if op.split(".")[0] in _INT_OPS else "other"


def parse(text: str) -> tuple[list[tuple[int, str, str, str]], dict[str, int]]:
    """``(instructions, labels)``: (address, predicate, opcode, text) per instruction; label -> address."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            instrs.append((addr, (m.group(2) or "").strip(), m.group(3), f"{m.group(3)} {m.group(4)}"))
            for label in pending:
                labels[label] = addr
            pending = []
    return instrs, labels


def main_loop(instrs, labels) -> tuple[int, int]:
    """Indices (first, back-edge) of the backward branch enclosing the most HGMMAs."""
    index = {addr: i for i, (addr, *_) in enumerate(instrs)}
    best = None
    for i, (addr, _, op, text) in enumerate(instrs):
        m = re.search(r"\.L_x_\d+", text)
        if op.startswith("BRA") and m and labels[m.group(0)] < addr:
            lo = index[labels[m.group(0)]]
            n = sum(x[2].startswith("HGMMA") for x in instrs[lo:i + 1])
            if n and (best is None or n > best[2]):
                best = (lo, i, n)
    if best is None:
        raise SystemExit("no loop with HGMMA found")
    return best[0], best[1]


def walk(instrs, labels, lo: int, hi: int, take_split: bool) -> list[tuple[int, str, str, str]]:
    index = {addr: i for i, (addr, *_) in enumerate(instrs)}
    path, i = [], lo
    while i <= hi:
        addr, pred, op, text = instrs[i]
        path.append(instrs[i])
        if op.startswith("BRA") and i != hi:
            target = index[labels[re.search(r"\.L_x_\d+", text).group(0)]]
            if re.search(r"BRA\s+!?U?P\d", text):  # two-predicate branch: the mask / no-mask split
                i = target if take_split else i + 1
                continue
            if instrs[i + 1][2].startswith("SYNCS.PHASECHK") or instrs[i - 1][2].startswith("SYNCS.PHASECHK"):
                # next to a try-wait: ``@P`` is its success (skip the retry block), ``@!P`` the retry
                # loop's exit (fall through; a second inline try-wait, as FA4 issues, is not a retry)
                i = i + 1 if pred.startswith("@!") else target
                continue
            i += 1  # another forward branch: assume not taken
            continue
        i += 1
    return path


def order(path) -> str:
    """HGMMA groups (ending at a ``gsb0``), waits, barriers, exp2 runs and stores, repeats compressed."""
    events, group = [], 0
    for _, _, op, text in path:
        if op.startswith("HGMMA"):
            group += 1
            if "gsb0" in text:
                a_regs = re.match(r"HGMMA\.\S+\s+R\d+,\s*R\d+,", text) is not None
                events.append(f"{op.split('.')[1]}x{group}({'A=regs' if a_regs else 'A=smem'})")
                group = 0
        elif op.startswith("WARPGROUP.DEPBAR"):
            events.append("wait<=" + text.split(",")[-1].strip().replace("0x", ""))
        elif op.startswith("MUFU.EX2"):
            events.append("EX2")
        elif op.startswith(("BAR", "SYNCS.ARRIVE", "SYNCS.PHASECHK", "STSM", "STS", "UBLKRED", "UTMA")):
            events.append(op.split(".")[0] if op.startswith(("BAR", "SYNCS")) else op)
    out: list[list] = []
    for e in events:
        if out and out[-1][0] == e:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return " | ".join(e + (f" x{n}" if n > 1 else "") for e, n in out)


def report(text: str) -> None:
    instrs, labels = parse(text)
    lo, hi = main_loop(instrs, labels)
    split = any(op.startswith("BRA") and re.search(r"BRA\s+!?U?P\d", t) for _, _, op, t in instrs[lo:hi])
    paths = {"not taken": walk(instrs, labels, lo, hi, False)}
    if split:
        paths["taken"] = walk(instrs, labels, lo, hi, True)
    print(f"loop {instrs[lo][0]:#06x}..{instrs[hi][0]:#06x}: {hi - lo + 1} static instructions; "
          f"columns: the in-loop two-predicate branch {'not taken / taken' if split else '(none)'}")
    counts = {name: collections.Counter(instruction_class(op) for _, _, op, _ in p) for name, p in paths.items()}
    for name, p in paths.items():
        counts[name]["TOTAL"] = len(p)
    classes = sorted(set().union(*counts.values()), key=lambda k: (k != "TOTAL", k))
    print(f"{'class':24s}" + "".join(f"{name:>12s}" for name in paths))
    for c in classes:
        print(f"{c:24s}" + "".join(f"{counts[name][c]:>12d}" for name in paths))
    for name, p in paths.items():
        print(f"\n[{name}] {order(p)}")
        groups, wait_at = 0, None
        for j, (_, _, op, t) in enumerate(p):
            groups += op.startswith("HGMMA") and "gsb0" in t
            if groups >= 2 and op.startswith("WARPGROUP.DEPBAR") and t.strip().endswith("0x0"):
                wait_at = j
                break
        if wait_at is not None:
            ex2 = [j for j, x in enumerate(p) if x[2].startswith("MUFU.EX2")]
            print(f"  MUFU.EX2 before / after the first full wait after two GEMM groups: "
                  f"{sum(j < wait_at for j in ex2)} / {sum(j > wait_at for j in ex2)}")
        top = collections.Counter(op for _, _, op, _ in p if instruction_class(op) == "int/addr").most_common(8)
        print("  int/addr: " + ", ".join(f"{op} {n}" for op, n in top))
    ops = [op for _, _, op, _ in instrs]
    print(f"\nwhole kernel: {len(instrs)} instructions, LDL {sum(o.startswith('LDL') for o in ops)}, "
          f"STL {sum(o.startswith('STL') for o in ops)}")


def compile_key(substring: str, kind: str | None) -> str:
    from flashattn_hopper import dispatch, sass
    from flashattn_hopper.jit import target_arch

    arch = target_arch()
    for families in (dispatch.BWD_KERNELS, dispatch.FWD_KERNELS):
        for family in families.values():
            for key in family.all_keys(arch):
                if substring in key.name and (kind is None or key.kernel == kind):
                    print(f"# {key.name}")
                    with tempfile.TemporaryDirectory() as tmp:
                        family.compile(key, options=f"--keep-cubin --dump-dir {tmp}")
                        return sass.disassemble(sorted(Path(tmp).glob("*.cubin"))[0], sass.find_nvdisasm())
    raise SystemExit(f"no {arch} key contains {substring!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("key", nargs="?", help="a substring of a kernel key's name")
    ap.add_argument("--kind", help="the key's kernel kind, e.g. bwd_sm90 or fwd_sm90")
    ap.add_argument("--sass", type=Path, help="read this SASS listing instead of compiling")
    args = ap.parse_args()
    if args.sass is None and args.key is None:
        ap.error("give a key substring or --sass")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    report(args.sass.read_text() if args.sass else compile_key(args.key, args.kind))


if __name__ == "__main__":
    main()

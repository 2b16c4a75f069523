"""Every kernel variant compiles for sm_80 and sm_90a with fake tensors, on a machine without a GPU.

With ``nvdisasm`` installed (the ``test`` extra brings it), the SASS is read: tensor-core MMAs must be
there and, where both head dims are <= 128, no local-memory spills (``LDL``/``STL``). Spills at larger
head dims (either of q/k's and v's) are printed, not failed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashattn_hopper import dispatch, sass

from ._subprocess import REPO, subprocess_env
from ._variant_keys import variant_keys


pytestmark = pytest.mark.compile_only
TARGETS = ["sm_80", "sm_90a"]
# Per kernel kind (the key's first field): instructions its SASS must contain.
EXPECTED_OPCODES = {
    "fwd_sm80": ("HMMA", "LDSM", "LDGSTS"),
    "fwd_sm90": ("HGMMA", "UTMALDG", "USETMAXREG"),
    # bwd_pre_sm80 / bwd_post_sm80 use plain loads and stores only (nothing in sass.OPCODES to require).
    "bwd_sm80": ("HMMA", "LDSM", "LDGSTS"),
    # the dQ writer warp's bulk reduce-add of the tile (UBLKRED), the score/gradient GEMMs, TMA loads
    "bwd_sm90": ("HGMMA", "UTMALDG", "UBLKRED", "USETMAXREG", "STSM"),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """arch -> {kernel name -> result row}; one fresh process per target arch."""
    results = {}
    for arch in TARGETS:
        work = tmp_path_factory.mktemp(arch)
        env = subprocess_env(FLASHATTN_HOPPER_CACHE="0")
        proc = subprocess.run([sys.executable, "-m", "tests._compile_variants", arch, str(work / "out.json"), str(work / "dump")],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-4000:]
        data = json.loads((work / "out.json").read_text())
        results[arch] = {"nvdisasm": data["nvdisasm"], "rows": {r["kernel"]: r for r in data["results"]}}
    return results


def _variants():
    for arch in TARGETS:
        for backend in dispatch.BACKENDS_FOR_TARGET[arch]:
            for family in dispatch.families(backend):
                for key in variant_keys(family, arch):
                    # The wider of q/k's and v's head dims sets the register budget (64/256 holds O at 256).
                    head_dim = max(getattr(key, "head_dim", 0), getattr(key, "head_dim_v", 0) or 0)
                    yield pytest.param(arch, key.name, head_dim, id=key.name)


@pytest.mark.parametrize("arch,name,head_dim", list(_variants()))
def test_variant_compiles_with_tensor_cores_and_no_spills(compiled, arch, name, head_dim):
    row = compiled[arch]["rows"][name]
    assert row["error"] is None, row["error"]
    print(f"{name}: compiled in {row['seconds']:.1f} s; SASS {row['counts']}")
    if compiled[arch]["nvdisasm"] is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm): compiled, SASS not checked")
    counts = row["counts"]
    assert counts is not None, "no cubin was written"
    for opcode in EXPECTED_OPCODES.get(name.split("-")[0], ()):
        if "e4m3" in name and opcode == "HGMMA":  # (e4m3 WGMMA disassembles as QGMMA)
            opcode = "QGMMA"
        assert counts[opcode] > 0, f"{name}: no {opcode} in the SASS: {counts}"
    if "-stmatrix_pds" in name:  # sm_90 backward rows that store P/dS with stmatrix
        assert counts["STSM"] > 0, f"{name}: no STSM in the SASS: {counts}"
    if "-cluster_m2" in name:  # sm90 forward rows whose CTA pairs share K/V by TMA multicast
        assert counts["UTMALDG.MULTICAST"] > 0, f"{name}: no multicast TMA load in the SASS: {counts}"
    elif name.startswith("fwd_sm90"):
        assert counts["UTMALDG.MULTICAST"] == 0, f"{name}: multicast TMA without a cluster: {counts}"
    spills = counts["LDL"] + counts["STL"]
    # ptxas serializes a kernel's WGMMAs (each k-step waits for the last) when it cannot keep their
    # registers in place: then most HGMMAs end a scoreboard group instead of one per GEMM.
    serialized = counts["HGMMA"] > 0 and 2 * counts[sass.HGMMA_GROUP_ENDS] > counts["HGMMA"]
    if head_dim <= 128:
        assert spills == 0, f"{name} spills to local memory: {counts['LDL']} LDL, {counts['STL']} STL"
        assert not serialized, f"{name}: WGMMAs serialized ({counts[sass.HGMMA_GROUP_ENDS]} of {counts['HGMMA']} wait)"
    else:
        if spills:
            print(f"note: {name} has {spills} local-memory instructions (head dim {head_dim})")
        if serialized:
            print(f"note: {name}: WGMMAs serialized ({counts[sass.HGMMA_GROUP_ENDS]} of {counts['HGMMA']} wait)")


@pytest.mark.parametrize("arch", TARGETS)
def test_launch_arguments_marshal_like_the_dsl(arch):
    """The launch path's ready-made scalar/stream/None arguments reach the kernel as the same bytes
    as the DSL's own conversion (tests/_launch_args.py; one fresh process per target arch)."""
    proc = subprocess.run([sys.executable, "-m", "tests._launch_args", arch], env=subprocess_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(proc.stdout)

"""Read a compiled kernel's SASS without a GPU: the instructions of its hot loop, the measure of an instruction-issue
bound (bench/gpu_static.py).

`disassemble(cubin)` runs the `cuobjdump -sass` bundled with triton; `loops(sass)` finds every loop as a backward
branch (`BRA` to an earlier address) and `hot_loop(sass)` picks the one that streams the weights: the innermost
loop with the most instructions (a GEMV's loop over K; unrolled inner loops are straight-line code inside it).
A loop's instruction count is what each warp issues per iteration (SIMT: one warp instruction per SASS line;
predicated-off lines still issue). NOPs and the loop's own branch are counted: they occupy issue slots too.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


def cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"no cuobjdump beside triton ({path})")
    return str(path)


def disassemble(cubin: bytes) -> str:
    """The SASS text of a cubin (`cuobjdump -sass`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), "-sass", f.name], check=True, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str


@dataclass(frozen=True)
class Loop:
    start: int  # address of the branch target (the loop's first instruction)
    end: int  # address of the backward branch
    instructions: tuple[Instruction, ...]

    def __len__(self) -> int:
        return len(self.instructions)

    def count(self, opcode_prefix: str) -> int:
        """Instructions whose opcode starts with this (e.g. "SHFL", "IDP", "LDG")."""
        return sum(_opcode(i.text).startswith(opcode_prefix) for i in self.instructions)


def _opcode(text: str) -> str:
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def instructions(sass: str) -> list[Instruction]:
    return [Instruction(int(m.group(1), 16), m.group(2)) for m in _LINE.finditer(sass)]


def _labels(sass: str) -> dict[str, int]:
    """cuobjdump prints targets as addresses; nvdisasm as labels. Map `.L_x_N` labels to the next address."""
    out: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"\s*\.?(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = _LINE.search(line)
        if m and pending:
            for name in pending:
                out[name] = int(m.group(1), 16)
            pending = []
    return out


def loops(sass: str) -> list[Loop]:
    """Every backward branch's loop, in address order."""
    ins = instructions(sass)
    labels = _labels(sass)
    found = []
    for i, inst in enumerate(ins):
        if _opcode(inst.text) not in ("BRA", "BRA.U"):  # .U: a uniform branch (the mma kernels' loops on sm_75)
            continue
        target = re.search(r"0x([0-9a-f]+)", inst.text)
        named = re.search(r"\.?(L_x_\d+)", inst.text)
        if target:
            to = int(target.group(1), 16)
        elif named and named.group(1) in labels:
            to = labels[named.group(1)]
        else:
            continue
        if to < inst.address:
            body = tuple(x for x in ins[: i + 1] if x.address >= to)
            found.append(Loop(to, inst.address, body))
    return found


def streaming_loop(sass: str) -> Loop | None:
    """`hot_loop` among the loops that load global memory: a warp-convergence spin (VOTE, YIELD, BRA: ptxas puts
    one inside attention's key loop on sm_75) would otherwise count as the innermost loop."""
    loading = [lp for lp in loops(sass) if lp.count("LDG")]
    inner = [lp for lp in loading if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in loading)]
    return max(inner, key=len, default=None)


def hot_loop(sass: str) -> Loop | None:
    """The innermost loop (containing no other) with the most instructions; None for straight-line code."""
    all_loops = loops(sass)
    inner = [
        lp for lp in all_loops if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in all_loops)
    ]
    return max(inner, key=len, default=None)

"""The collectives of an optimized HLO module, read from its text (`compiled.as_text()`): which
op, which result shapes, how many devices per group. Where work runs is shown this way, not by
equal numbers (tests/models/test_sequence_parallel_hlo.py, bench/sequence_parallel.py).

`Module` parses the module's instructions, so that a collective's operand can be followed to
what it holds: back to an entry parameter of the program (`Module.source`: a weight sliced out
of its layer stack and cast, never computed on, named by the argument jax writes into the
parameter's metadata, `params['layers']['q_proj']`), or forward out of the program
(`Module.updates_state`: a gradient on its way into the updated state). `operand_roles` tells
weights, gradients and activations apart that way, and `replica_groups` / `spans` which mesh
axes a collective's device groups cross.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\((.*)$")
_SHAPE = re.compile(r"\b(pred|s32|u32|s8|u8|bf16|f16|f32|f64)\[([\d,]*)\]")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "f64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group: int  # devices per replica group (1: a no-op)
    line: str
    name: str = ""  # the instruction's name, and the computation it sits in (for `Module`)
    computation: str = ""

    @property
    def nbytes(self) -> int:
        return sum(BYTES[dt] * math.prod(dims) for dt, dims in self.shapes)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[dims]T(perm)`: 0..n-1 laid out as `dims`, transposed."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape(-1)


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective's HLO line, in the logical device ids of the program
    (a jitted program's are its mesh's devices in order), or None where the line states none
    (every device in one group). A collective-permute's groups are its source-target pairs."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), -1).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(?\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\)?)? \{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        shape = [int(n) for _, n in axes]
        ids = (_iota(m.group(2), m.group(3)) if m.group(2)
               else np.arange(math.prod(shape))).reshape(shape)
        over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(4)]
        rest = [i for i in range(len(axes)) if i not in over]
        return ids.transpose(rest + over).reshape(-1, math.prod(shape[i] for i in over)).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m and m.group(1):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}",
                                                                        m.group(1))]
    return None


def spans(line: str, mesh_shape: tuple[int, ...], axis: int) -> bool:
    """Whether the collective of an HLO line moves data between devices at different positions
    along mesh axis `axis` (of a mesh of `mesh_shape`, its devices in the program's order)."""
    groups = replica_groups(line)
    if groups is None:
        return mesh_shape[axis] > 1
    coords = lambda d: np.unravel_index(d, mesh_shape)[axis]  # noqa: E731
    return any(len({int(coords(d)) for d in g}) > 1 for g in groups)


def collectives(text: str) -> list[Collective]:
    """Every collective of an optimized HLO module: its op, result shapes and group size."""
    out = []
    computation = ""
    for line in text.splitlines():
        if header := _HEADER.match(line):
            computation = header.group(1)
        m = _COLLECTIVE.search(line)
        if m:
            shapes = tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                           for dt, dims in _SHAPE.findall(m.group(1)))
            named = _INSTRUCTION.match(line)
            groups = replica_groups(m.group(3))
            # 0: groups not stated (all devices); a collective-permute's are pairs.
            size = len(groups[0]) if groups else 0
            out.append(Collective(m.group(2), shapes, size, line.strip(),
                                  named.group(2) if named else "", computation))
    return out


def operand_roles(text: str, weights: str = "params") -> list[tuple[Collective, int, str]]:
    """(collective, operand index, role) for each operand of each all-gather, all-reduce and
    reduce-scatter of an optimized HLO module, by what the operand holds rather than its shape:
    "weights" (an entry parameter under the program's argument `weights`, sliced out of its
    layer stack and cast but never computed on), "gradients" (values that leave the program
    as they are or elementwise, into the updated parameters or optimizer state) or
    "activations" (anything else: computed and consumed inside, or the batch's)."""
    module = Module(text)
    out = []
    for c in collectives(text):
        if c.op in ("all-to-all", "collective-permute"):
            continue
        operands = module.computations[c.computation][c.name].operands
        for i, operand in enumerate(operands):
            source = module.source(c.computation, operand)
            if source is not None and (source == weights or source.startswith(weights + "[")):
                role = "weights"
            elif source is None and module.updates_state(
                    c.computation, c.name, i if len(operands) > 1 else None):
                role = "gradients"
            else:
                role = "activations"
            out.append((c, i, role))
    return out


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# Ops whose result holds its (first) operand's values, moved, cast or sliced but not computed
# on: following them back from a collective finds where its data comes from.
_PASS_THROUGH = {"bitcast", "reshape", "convert", "copy", "transpose", "slice", "dynamic-slice",
                 "bitcast-convert", "copy-start", "copy-done", "all-gather", "all-gather-start",
                 "all-gather-done"}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    operands: tuple[str, ...]  # instruction names; for a parameter, its number as text
    attrs: str  # what follows the operand list: index=, calls=, body=, metadata=, ...
    shape: str = ""  # the result's type, e.g. f32[8,16]{1,0} or a tuple of them

    @property
    def dims(self) -> tuple[int, ...] | None:
        """The dimensions of an array result (None for a tuple)."""
        m = _SHAPE.match(self.shape)
        if self.shape.startswith("(") or not m:
            return None
        return tuple(int(d) for d in m.group(2).split(",") if d)

    def index(self) -> int:
        """A get-tuple-element's element index."""
        return int(re.search(r"\bindex=(\d+)", self.attrs).group(1))


def _split_instruction(rest: str) -> tuple[str, str, str, str] | None:
    """(result shape, opcode, operand text, attributes) of the text after `name = `."""
    end, depth = 0, 0
    if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
        for end, ch in enumerate(rest):  # noqa: B007 (where the loop stops is the result)
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
    shape_end = rest.index(" ", end)
    m = re.match(r" ([\w\-]+)\(", rest[shape_end:])
    if not m:
        return None
    start = shape_end + m.end()
    depth = 1
    for j in range(start, len(rest)):
        depth += (rest[j] == "(") - (rest[j] == ")")
        if depth == 0:
            return rest[:shape_end], m.group(1), rest[start:j], rest[j + 1:]
    return None


class Module:
    """An optimized HLO module's instructions, by computation, and which instruction calls each
    computation (a while loop's body, a fusion's fused computation, a call)."""

    def __init__(self, text: str):
        self.computations: dict[str, dict[str, Instruction]] = {}
        self.roots: dict[str, str] = {}
        self.entry = ""
        self.callers: dict[str, list[tuple[str, Instruction]]] = {}
        self.users: dict[tuple[str, str], list[Instruction]] = {}
        # The outputs that replace an input (`input_output_alias`, a donated argument's), by
        # their index in the output tuple as text ("" for a single output).
        alias = re.search(r"input_output_alias=\{(.*?)\}, \w+=", text.split("\n", 1)[0])
        self.aliased = set(re.findall(r"\{(\d*)\}: \(", alias.group(1))) if alias else set()
        current: dict[str, Instruction] = {}
        name = ""
        for line in text.splitlines():
            if header := _HEADER.match(line):
                name = header.group(1)
                current = self.computations.setdefault(name, {})
                if line.startswith("ENTRY"):
                    self.entry = name
                continue
            m = _INSTRUCTION.match(line)
            if not m or not name:
                continue
            parts = _split_instruction(m.group(3))
            if parts is None:
                continue
            shape, opcode, operands, attrs = parts
            ops = ((operands.strip(),) if opcode == "parameter"
                   else tuple(_NAME.findall(operands)))
            inst = Instruction(m.group(2), opcode, ops, attrs, shape)
            current[inst.name] = inst
            for o in ops:
                self.users.setdefault((name, o), []).append(inst)
            if m.group(1):
                self.roots[name] = inst.name
            for callee in _callees(attrs):
                self.callers.setdefault(callee, []).append((name, inst))

    def source(self, computation: str, name: str) -> str | None:
        """The entry parameter whose values instruction `name` of `computation` holds, moved,
        cast or sliced but not computed on (through fusions of such ops, and through a while
        loop's state where the loop passes it on unchanged, as a scanned layer stack is): the
        parameter's argument name (its metadata's op_name, e.g. `params['embed']`), or its
        number as `parameter N` where it has none. None for a value computed from others."""
        seen = set()
        while (computation, name) not in seen:
            seen.add((computation, name))
            inst = self.computations.get(computation, {}).get(name)
            if inst is None:
                return None
            if inst.opcode in _PASS_THROUGH:
                name = inst.operands[0]
            elif inst.opcode in ("fusion", "call"):
                callee = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)", inst.attrs)
                if callee is None or callee.group(1) not in self.roots:
                    return None
                computation = callee.group(1)
                name = self.roots[computation]
            elif inst.opcode == "parameter":
                if computation == self.entry:
                    op_name = _OP_NAME.search(inst.attrs)
                    return (op_name.group(1).replace("\\'", "'") if op_name
                            else f"parameter {inst.operands[0]}")
                calls = self.callers.get(computation, [])
                if len(calls) != 1 or calls[0][1].opcode not in ("fusion", "call"):
                    return None  # a loop's state as a whole, or a computation called twice
                computation, caller = calls[0]
                name = caller.operands[int(inst.operands[0])]
            elif inst.opcode == "get-tuple-element":
                found = self._element(computation, inst)
                if found is None:
                    return None
                computation, name = found
            else:
                return None
        return None

    def _element(self, computation: str, inst: Instruction) -> tuple[str, str] | None:
        """Where element `index` of a get-tuple-element's tuple comes from: a tuple's operand,
        or, for a while loop's state element that its body passes on unchanged, the loop's
        initial value of it. None when the loop changes it (an activation carried along)."""
        index = inst.index()
        insts = self.computations[computation]
        of = insts.get(inst.operands[0])
        if of is None:
            return None
        if of.opcode == "tuple":
            return computation, of.operands[index]
        if of.opcode == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", of.attrs).group(1)
        elif of.opcode == "parameter" and computation != self.entry:
            calls = self.callers.get(computation, [])
            if len(calls) != 1 or calls[0][1].opcode != "while":
                return None
            body, (computation, of) = computation, calls[0]
        else:
            return None
        if not self._passes_on(body, index):
            return None
        init = self.computations[computation].get(of.operands[0])
        if init is None or init.opcode != "tuple":
            return None
        return computation, init.operands[index]

    def _passes_on(self, body: str, index: int) -> bool:
        """Whether a while body returns element `index` of its state as it got it."""
        insts = self.computations.get(body, {})
        root = insts.get(self.roots.get(body, ""))
        if root is None or root.opcode != "tuple":
            return False
        inst = insts.get(root.operands[index])
        while inst is not None and inst.opcode in ("copy", "bitcast"):
            inst = insts.get(inst.operands[0])
        return (inst is not None and inst.opcode == "get-tuple-element"
                and inst.index() == index
                and insts.get(inst.operands[0], inst).opcode == "parameter")

    def updates_state(self, computation: str, name: str, index: int | None = None) -> bool:
        """Whether the values of instruction `name` (element `index` of a tuple result, such as
        one operand's share of a combined all-reduce) leave the program as they are or through
        elementwise work, into an output that replaces one of its inputs (donated parameters
        or optimizer state): a gradient on its way into the update. An activation does not
        (a matmul, a reduction or a gather consumes it first), nor a result such as log-probs
        (its output replaces no input)."""
        work = [(computation, name, index)]
        seen = set()
        while work:
            item = work.pop()
            if item in seen:
                continue
            seen.add(item)
            comp, at, element = item
            if at == self.roots.get(comp):
                if comp == self.entry:
                    if element is None and "" in self.aliased:
                        return True
                    continue
                work += self._after_root(comp, element)
            for user in self.users.get((comp, at), []):
                if element is not None:
                    if user.opcode == "get-tuple-element" and user.index() == element:
                        work.append((comp, user.name, None))
                    elif user.opcode == "tuple":  # a tuple of tuples: not followed
                        continue
                    continue
                if user.opcode == "tuple":
                    i = user.operands.index(at)
                    if user.name == self.roots.get(comp) and comp == self.entry:
                        if str(i) in self.aliased:
                            return True
                        continue
                    work.append((comp, user.name, i))
                    if user.name == self.roots.get(comp):
                        work += self._after_root(comp, i)
                    for then in self.users.get((comp, user.name), []):
                        work += self._into(then, user.name, i)
                elif user.opcode == "conditional":
                    work += self._into(user, at, None)
                elif self._keeps_values(comp, at, user):
                    work.append((comp, user.name, None))
        return False

    def _into(self, user: Instruction, operand: str, element: int | None):
        """Where `operand` (element `element` of it) goes inside the computation that a while
        loop (its state) or a conditional (a branch's argument) runs on it."""
        if user.opcode == "while":
            bodies = [re.search(r"\bbody=%?([\w.\-]+)", user.attrs).group(1)]
        elif user.opcode == "conditional" and user.operands.index(operand) > 0:
            bodies = [_callees(user.attrs)[user.operands.index(operand) - 1]]
        else:
            return []
        out = []
        for body in bodies:
            param = next((n for n, x in self.computations.get(body, {}).items()
                          if x.opcode == "parameter"), None)
            if param is not None:
                out.append((body, param, element))
        return out

    def _after_root(self, comp: str, element: int | None) -> list[tuple[str, str, int | None]]:
        """Where a computation's result goes in its callers: a loop's result (and its next
        iteration's state), a fusion's or a call's result."""
        out = []
        for caller_comp, caller in self.callers.get(comp, []):
            if caller.opcode == "while":
                out.append((caller_comp, caller.name, element))
                param = next((n for n, x in self.computations[comp].items()
                              if x.opcode == "parameter"), None)
                if param is not None:
                    out.append((comp, param, element))
            elif caller.opcode == "conditional":
                out.append((caller_comp, caller.name, element))
            elif caller.opcode in ("fusion", "call") and element is None:
                out.append((caller_comp, caller.name, None))
        return out

    def _keeps_values(self, comp: str, operand: str, user: Instruction) -> bool:
        """Whether `user` carries `operand`'s values on elementwise (same shape, or moved,
        cast, sliced, updated into a buffer, or reduced across devices)."""
        if user.opcode in _PASS_THROUGH or user.opcode in _CARRIES:
            return True
        same = user.dims is not None and user.dims == self.computations[comp][operand].dims \
            if operand in self.computations[comp] else False
        if user.opcode in _ELEMENTWISE:
            return same
        if user.opcode == "fusion":
            callee = re.search(r"\bcalls=%?([\w.\-]+)", user.attrs)
            body = self.computations.get(callee.group(1), {}) if callee else {}
            # Elementwise on it, moved, sliced or written into a buffer (a layer's gradient
            # into the stack of all layers'), but never consumed.
            return not any(x.opcode in _CONSUMES for x in body.values())
        return False


def _callees(attrs: str) -> list[str]:
    """The computations an instruction runs: a fusion's, a call's, a while loop's body (not its
    condition), a conditional's branches in order."""
    out = re.findall(r"\b(?:calls|body|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)", attrs)
    branches = re.search(r"\bbranch_computations=\{([^}]*)\}", attrs)
    if branches:
        out += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return out


_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "negate", "select", "maximum",
                "minimum", "sqrt", "rsqrt", "abs", "clamp", "power", "exponential", "log"}
# Ops whose result holds the operand's values as they are, reshaped or summed over devices.
_CARRIES = {"dynamic-update-slice", "all-reduce", "all-reduce-start", "all-reduce-done",
            "reduce-scatter", "pad", "concatenate"}
# Ops after which a value is used up: its result is another quantity.
_CONSUMES = {"dot", "convolution", "reduce", "reduce-window", "gather", "scatter", "sort",
             "custom-call"}

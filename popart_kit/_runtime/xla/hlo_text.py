"""What a compiled program's HLO text says about its onnxruntime segments' callbacks.

Pure text, no JAX: the entry computation's instructions (:func:`entry`), whether the program
calls Python at all (:func:`has_host_callbacks`), and two questions the runtime asks of an
inference program that delegates (see :mod:`.delegated`):

* :func:`callback_only_parameters`: the parameters nothing reads but the callbacks (the program
  may then take an unfilled buffer for them; the callbacks read the caller's array);
* :func:`one_callback`: whether the program is nothing but one callback between its parameters
  and its results (bitcasts and copies that move no byte aside), and which parameter each of
  the callback's operands is and which of its results each program result is (the run may
  then call the callback itself).

Both are conservative: any other instruction, a callback whose result may alias an operand, or
text not understood, and the answer is "no".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CALLBACK_TARGET", "Instruction", "OneCallback", "callback_only_parameters", "entry",
           "has_host_callbacks", "one_callback"]

#: The custom call a ``jax.experimental.buffer_callback`` lowers to on CPU.
CALLBACK_TARGET = "xla_buffer_python_cpu_callback"

_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\S*\s+([\w\-]+)\(")  # the shape's end, then the opcode
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class Instruction:
    """One instruction of the entry computation: ``operands`` by name, ``line`` its text."""

    name: str
    opcode: str
    operands: tuple[str, ...]
    line: str
    root: bool

    @property
    def callback(self) -> bool:
        """A segment's callback whose results are memory of their own."""
        return (self.opcode == "custom-call" and f'custom_call_target="{CALLBACK_TARGET}"'
                in self.line and "output_to_operand_aliasing" not in self.line)

    def number(self, attribute: str) -> int | None:
        """The integer ``attribute(N)`` or ``attribute=N`` of the line (parameter, index)."""
        found = re.search(rf"\b{attribute}[(=](\d+)", self.line)
        return int(found.group(1)) if found else None


def _closing(text: str, start: int) -> int:
    """The index just past the parenthesis closing the one open before ``start`` (-1: none)."""
    depth = 1
    for j in range(start, len(text)):
        depth += text[j] == "("
        depth -= text[j] == ")"
        if depth == 0:
            return j + 1
    return -1


def _parse(line: str) -> Instruction | None:
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    rest = head.group(3)
    after_shape = _closing(rest, 1) if rest.startswith("(") else 0  # a tuple shape
    match = _OPCODE.match(rest, max(after_shape, 0))
    end = _closing(rest, match.end()) if match else -1
    if match is None or after_shape < 0 or end < 0:
        return None
    operands = tuple(_OPERAND.findall(rest[match.end():end - 1]))
    return Instruction(head.group(2), match.group(1), operands, line, bool(head.group(1)))


def _block(text: str) -> list[Instruction] | None:
    """The instructions of a computation's text from its header line to its closing brace."""
    out = []
    for line in text.split("\n}", 1)[0].splitlines()[1:]:
        instruction = _parse(line)
        if instruction is None:
            return None
        out.append(instruction)
    return out


def entry(hlo: str) -> list[Instruction] | None:
    """The entry computation's instructions, in order (None: no entry computation, or a line
    not of the form ``[ROOT] name = shape opcode(operands)...``)."""
    parts = hlo.split("\nENTRY ", 1)
    return _block(parts[1]) if len(parts) == 2 else None


def _computation(hlo: str, name: str) -> list[Instruction] | None:
    """The instructions of the (non-entry) computation ``name``."""
    parts = hlo.split(f"\n%{name} (", 1)
    return _block(parts[1]) if len(parts) == 2 else None


_ARRAY = re.compile(r"\w+\[([\d,]*)\]\{([\d,]*)")


def _layout(line: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """An array instruction's dimensions and its layout (minor to major) without the
    dimensions of size 1, which place no bytes (None: not an array of that form)."""
    found = _ARRAY.match(line.split("=", 1)[1].lstrip())
    if found is None:
        return None
    dims = tuple(int(d) for d in found.group(1).split(",") if d)
    order = tuple(int(d) for d in found.group(2).split(",") if d)
    return dims, tuple(d for d in order if d < len(dims) and dims[d] != 1)


def _same_bytes(copy: Instruction, operand: Instruction) -> bool:
    """Whether ``copy`` leaves every byte of ``operand`` where it is: the same dimensions,
    laid out alike but for dimensions of size 1."""
    mine, theirs = _layout(copy.line), _layout(operand.line)
    return mine is not None and mine == theirs


def _moves_no_bytes(hlo: str, instruction: Instruction, operand: Instruction) -> bool:
    """Whether ``instruction`` is a copy of ``operand`` that keeps every byte where it is,
    or a fusion of bitcasts and one such copy."""
    if instruction.opcode == "copy":
        return _same_bytes(instruction, operand)
    called = re.search(r"calls=%([\w.\-]+)", instruction.line)
    body = _computation(hlo, called.group(1)) if instruction.opcode == "fusion" and called \
        else None
    if body is None or [i.opcode for i in body].count("parameter") != 1 or any(
            i.opcode not in ("parameter", "bitcast", "copy") for i in body):
        return False
    copies = [i for i in body if i.opcode == "copy"]
    inside = {i.name: i for i in body}
    return (len(copies) == 1 and copies[0].root and copies[0].operands[0] in inside
            and _same_bytes(copies[0], inside[copies[0].operands[0]]))


_HOST_CALLBACK = re.compile(r'custom_call_target="xla_(?:buffer_|ffi_)?python_cpu_callback"')


def has_host_callbacks(hlo: str) -> bool:
    """Whether any computation of the program calls Python on the host (a segment's buffer
    callback, ``jax.pure_callback``, ``jax.experimental.io_callback``)."""
    return _HOST_CALLBACK.search(hlo) is not None


def callback_only_parameters(hlo: str) -> set[int]:
    """The numbers of the entry computation's parameters that nothing reads but segment
    callbacks, directly or through bitcasts (the same bytes)."""
    instructions = entry(hlo)
    if instructions is None:
        return set()
    users: dict[str, list[Instruction]] = {}
    for instruction in instructions:
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)

    def only_callbacks(name: str) -> bool:  # a bitcast the program returns: read by the caller
        uses = users.get(name, [])
        return bool(uses) and all(u.callback or (u.opcode == "bitcast" and not u.root and
                                                 only_callbacks(u.name)) for u in uses)

    return {n for i in instructions if i.opcode == "parameter" and only_callbacks(i.name)
            and (n := i.number("parameter")) is not None}


@dataclass(frozen=True)
class OneCallback:
    """A program that is one callback: ``operands[k]`` is the number of the parameter the
    callback's operand k is, ``results[j]`` the callback result program result j is;
    ``parameters`` how many the program takes."""

    operands: tuple[int, ...]
    results: tuple[int, ...]
    parameters: int


def one_callback(hlo: str) -> OneCallback | None:
    """The program as one callback (see :class:`OneCallback`), or None: it computes anything
    else, reads no parameter directly, or returns something other than each of the callback's
    results once (through bitcasts, or a tuple of them)."""
    instructions = entry(hlo)
    if instructions is None:
        return None
    by_name = {i.name: i for i in instructions}
    calls = [i for i in instructions if i.opcode == "custom-call"]
    allowed = {"parameter", "bitcast", "custom-call", "get-tuple-element", "tuple"}
    same = {i.name for i in instructions if i.opcode in ("copy", "fusion") and len(
        i.operands) == 1 and i.operands[0] in by_name and _moves_no_bytes(
            hlo, i, by_name[i.operands[0]])}
    if len(calls) != 1 or not calls[0].callback or any(
            (i.opcode not in allowed and i.name not in same)
            or (i.opcode == "tuple" and not i.root) for i in instructions):
        return None
    call = calls[0]

    def source(name: str) -> Instruction | None:  # back through what moves no bytes
        while name in by_name and (by_name[name].opcode == "bitcast" or name in same):
            name = by_name[name].operands[0]
        return by_name.get(name)

    operands = []
    for name in call.operands:
        found = source(name)
        number = found.number("parameter") if found and found.opcode == "parameter" else None
        if number is None:
            return None
        operands.append(number)
    [root] = [i for i in instructions if i.root] or [None]
    if root is None:
        return None
    returned = root.operands if root.opcode == "tuple" else (root.name,)
    tupled = call.line.split("=", 1)[1].lstrip().startswith("(")
    results = []
    for name in returned:
        found = source(name)
        if found is call and not tupled:
            results.append(0)
        elif (found is not None and found.opcode == "get-tuple-element" and tupled
              and source(found.operands[0]) is call and found.number("index") is not None):
            results.append(found.number("index"))
        else:
            return None
    if sorted(results) != list(range(len(results))):
        return None
    count = sum(i.opcode == "parameter" for i in instructions)
    return OneCallback(tuple(operands), tuple(results), count)  # type: ignore[arg-type]

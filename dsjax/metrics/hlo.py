"""Collectives in compiled HLO: which devices talk, how many bytes each one sends, and which
op or kernel names denote a collective (for reading profiler traces)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Name fallbacks, tried in order on a normalised name (lower case, "_" and " " -> "-"):
# reduce-scatter before all-reduce, because JAX calls it psum_scatter.
_NAME_PATTERNS = (
    ("reduce-scatter", re.compile(r"reduce-?scatter|psum-scatter")),
    ("all-gather", re.compile(r"all-?gather")),
    ("all-to-all", re.compile(r"all-?to-?all")),
    ("collective-permute", re.compile(r"collective-permute|ppermute|sendrecv")),
    ("all-reduce", re.compile(r"all-?reduce|(?:^|[^a-z])p(?:sum|max|min)(?:$|[^a-z])")),
)
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.+?\s(?P<op>" + "|".join(KINDS) +
    r")(?:-start|-done)?\(")

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# Newer XLA prints GSPMD's groups as mesh axes: replica_groups=mesh['axis_0'=4,'axis_2'=2]
# {'axis_0'}, device ids row-major over the axes unless `device_ids=([4,2]T(1,0))` (an iota
# reshaped and transposed) says otherwise; a group varies over the braced axes.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                          r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?"
                          r"\s*\{(?P<over>[^}]*)\}")
_IOTA_IDS = re.compile(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$")


def _listed_groups(m: re.Match) -> str:
    """A mesh-axes replica group list rewritten as the explicit `{{0,2,...},...}` form that
    `hlo_collectives` reads; forms not understood (sub-axes) fail loudly."""
    sizes = {}
    for item in m["axes"].split(","):
        name, _, size = item.partition("=")
        sizes[name.strip().strip("'")] = int(size)
    over = [a.strip().strip("'") for a in m["over"].split(",") if a.strip()]
    if any(a not in sizes for a in over):
        raise ValueError(f"unsupported replica groups: {m[0]}")
    count = math.prod(sizes.values())
    ids = np.arange(count)
    if m["ids"]:
        iota = _IOTA_IDS.match(m["ids"].strip())
        if iota:
            ids = ids.reshape([int(d) for d in iota["dims"].split(",")])
            if iota["perm"]:
                ids = ids.transpose([int(p) for p in iota["perm"].split(",")])
        elif re.fullmatch(r"[\d,\s]+", m["ids"]):
            ids = np.array([int(d) for d in m["ids"].split(",")])
        else:
            raise ValueError(f"unsupported replica groups: {m[0]}")
    ids = ids.reshape(tuple(sizes.values()))
    names = list(sizes)
    rest = [names.index(a) for a in names if a not in over]
    ids = ids.transpose(rest + [names.index(a) for a in over])
    groups = ids.reshape(-1, math.prod(sizes[a] for a in over)).tolist()
    return "replica_groups={" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"



@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled HLO program. `groups` hold partition ids: positions in the
    jitted function's device order (the mesh's `devices.flat`); a collective-permute's groups
    are its (source, target) pairs."""
    op: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def sent_bytes(self) -> float:
        """Bytes one device sends, ring model: all-reduce 2(W-1)/W of the buffer; all-gather
        (W-1)/W of its output; all-to-all (W-1)/W of its buffer (it keeps its own chunk);
        reduce-scatter (W-1)/W of its input (= W x output); collective-permute its buffer."""
        w = self.group_size
        frac = (w - 1) / w
        return {"all-reduce": 2 * frac * self.result_bytes,
                "all-gather": frac * self.result_bytes,
                "all-to-all": frac * self.result_bytes,
                "reduce-scatter": frac * w * self.result_bytes,
                "collective-permute": float(self.result_bytes)}[self.op]

    def spans(self, mesh_shape: tuple[int, ...], axis: int) -> bool:
        """Whether some group holds devices at different coordinates of mesh axis `axis`
        (e.g. the data-parallel collectives: axis = the index of "data")."""
        coords = [{int(np.unravel_index(d, mesh_shape)[axis]) for d in g} for g in self.groups]
        return any(len(c) > 1 for c in coords)


def hlo_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """Every collective in compiled HLO text where collectives are synchronous (CPU; an async
    GPU `*-start` with a tuple result would be over-counted). An empty `replica_groups={}` means
    one group of all `num_devices`; a group that cannot be read fails loudly rather than being
    counted as free."""
    out = []
    for line in _MESH_GROUPS.sub(_listed_groups, hlo).splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        nbytes = sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in _ARRAY.findall(m["shape"]))
        rest = m["rest"]
        if "replica_groups={}" in rest:
            groups = (tuple(range(num_devices)),)
        elif listed := _LIST_GROUPS.search(rest):
            groups = tuple(tuple(int(d) for d in g.split(",") if d)
                           for g in re.findall(r"\{([\d,]*)\}", listed[1]))
        elif iota := _IOTA_GROUPS.search(rest):
            dims = [int(d) for d in iota[3].split(",")]
            ids = np.arange(math.prod(dims)).reshape(dims)
            if iota[4]:
                ids = ids.transpose([int(p) for p in iota[4].split(",")])
            groups = tuple(map(tuple, ids.reshape(int(iota[1]), int(iota[2])).tolist()))
        else:
            raise ValueError(f"unreadable replica groups: {line.strip()[:120]} ... "
                             f"{rest[rest.find('replica_groups'):][:160]}")
        if not groups or not groups[0]:
            raise ValueError(f"empty replica groups: {line.strip()[:200]}")
        out.append(Collective(m["op"], nbytes, groups))
    return out


def axis_collectives(hlo: str, mesh: Any, axis: str) -> list[Collective]:
    """The collectives of compiled `hlo` (jitted over `mesh`) that move data along `axis`."""
    shape = tuple(mesh.devices.shape)
    index = list(mesh.axis_names).index(axis)
    return [c for c in hlo_collectives(hlo, mesh.devices.size) if c.spans(shape, index)]


def collective_kind(name: str) -> str | None:
    """The collective kind an op or kernel name denotes, or None for anything else."""
    norm = name.lower().replace("_", "-").replace(" ", "-")
    for kind, pattern in _NAME_PATTERNS:
        if pattern.search(norm):
            return kind
    return None


def hlo_collective_ops(hlo_text: str) -> dict[str, str]:
    """{instruction name: collective kind} for every collective (and its -start/-done halves) in
    compiled HLO text; the profiler names XLA ops by these instruction names."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_INSTRUCTION.match(line)
        if m:
            out[m["name"]] = m["op"]
    return out


def collective_bytes(hlo_text: str, num_devices: int | None = None) -> dict[str, float]:
    """Bytes one device sends per call of compiled `hlo_text`, per collective kind, ring model:
    all-reduce 2(W-1)/W x buffer; all-gather and reduce-scatter (W-1)/W x the full (gathered,
    pre-scatter) buffer; all-to-all (W-1)/W x buffer; collective-permute the buffer. W is each
    collective's group size; `num_devices` (default: the module's `num_partitions`, else 1)
    sizes groups written as `replica_groups={}`. Synchronous (CPU) HLO; see
    `hlo_collectives`."""
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        num_devices = int(m[1]) if m else 1
    out: dict[str, float] = collections.defaultdict(float)
    for c in hlo_collectives(hlo_text, num_devices):
        out[c.op] += c.sent_bytes()
    return dict(sorted(out.items()))


def computations_in_loops(compiled_hlo: str) -> tuple[dict[str, list[str]], set[str]]:
    """({computation name: its instruction lines}, the names of the computations the entry's
    while loops run, transitively: bodies, and the fusions and calls in them) of optimised HLO
    text. What runs once per step is in the entry outside that set; what runs per iteration
    (a micro-batch, a pipeline tick, a layer) is inside it."""
    comps: dict[str, list[str]] = {}
    calls: dict[str, set[str]] = {}
    current = entry = None
    for line in compiled_hlo.splitlines():
        head = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = head[2]
            comps[current], calls[current] = [], set()
            entry = current if head[1] else entry
        elif current and line.startswith("  "):
            comps[current].append(line)
            for group, one in re.findall(
                    r"(?:calls|to_apply|body|condition)=(?:\{([^}]*)\}|%?([\w.\-]+))", line):
                calls[current] |= {c.strip().lstrip("%") for c in (group or one).split(",")}
    looped: set[str] = set()
    for line in comps.get(entry, []):
        if " while(" in line:
            todo = [re.search(r"body=%?([\w.\-]+)", line)[1]]
            while todo:
                name = todo.pop()
                if name not in looped:
                    looped.add(name)
                    todo += calls.get(name, ())
    return comps, looped


def looped_axis_bytes(compiled_hlo: str, mesh: Any, axis: str) -> float:
    """Bytes one device sends along `axis` per call of compiled `compiled_hlo`, each collective
    counted as often as it runs (`looped_axis_traffic`)."""
    return looped_axis_traffic(compiled_hlo, mesh, axis)[1]


def looped_axis_traffic(compiled_hlo: str, mesh: Any, axis: str) -> tuple[float, float]:
    """(collective calls, bytes one device sends) along `axis` per call of compiled
    `compiled_hlo`, each collective counted as often as it runs: times the known trip counts
    (XLA's `known_trip_count`) of the while loops around it. A loop whose count XLA does not
    know counts once; a conditional counts its costliest branch (an upper bound: a pipeline
    tick's branch may be skipped)."""
    comps, _ = computations_in_loops(compiled_hlo)
    entry = next(m[1] for m in re.finditer(r"^ENTRY %?([\w.\-]+)", compiled_hlo, re.M))
    shape = tuple(mesh.devices.shape)
    index = list(mesh.axis_names).index(axis)
    memo: dict[str, np.ndarray] = {}

    def sent(name: str) -> np.ndarray:  # (calls, bytes) of one call of `name` and its callees
        if name not in memo:
            memo[name] = np.zeros(2)  # (a cycle, which HLO does not have, would count once)
            lines = comps.get(name, [])
            own = [c.sent_bytes() for c in hlo_collectives("\n".join(lines), mesh.devices.size)
                   if c.spans(shape, index)]
            total = np.array([len(own), sum(own)], dtype=float)
            for line in lines:
                count = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                for kind, group, one in re.findall(
                        r"(calls|to_apply|body|condition)=(?:\{([^}]*)\}|%?([\w.\-]+))", line):
                    factor = int(count[1]) if count and kind == "body" else 1
                    total += factor * sum(sent(c.strip().lstrip("%"))
                                          for c in (group or one).split(","))
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                pair = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
                names = [c.strip().lstrip("%") for c in branches[1].split(",")] if branches \
                    else pair
                if names:
                    total += max((sent(c) for c in names), key=lambda x: tuple(x[::-1]))
            memo[name] = total
        return memo[name]

    calls, nbytes = sent(entry)
    return float(calls), float(nbytes)

"""Topology files: servers (F_n, beta_n, G_n, C_n) and directed links (bandwidth, delay).

YAML units are the paper's: TFLOPS, GB/s, GB (10^9 bytes), Gbit/s and ms.
``TopologySpec.to_cluster`` converts to SI units for ``hetroute``.

A server names a GPU class of the catalogue (``gpu: a40``, see
``hetroute.hardware.CATALOGUE``) and may override any of its numbers, or
gives the numbers alone. Fields a server lacks (``mem_bw_gb_s`` in files
written before the hardware model) are taken from the class nearest in F_n
and G_n; ``TopologySpec.resolved()`` fills them in and says so per server.

A link entry covers one direction, or both with ``symmetric: true``. Every
ordered pair of distinct servers must be covered exactly once; a bad file gets
one line naming the field, e.g. ``paper10.yaml: links[3].delay_ms: must be >= 0``.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetroute.hardware import CATALOGUE, HardwareError, gpu_class, nearest_class
from hetroute.system import Cluster


class TopologyError(ValueError):
    """A topology file that does not load; the message is one line."""


_UNION_TAGS = {"float", "int", "str", "bool", "dict", "list", "GeneratedTopology"}


def one_line(err: ValidationError, source: str) -> str:
    """First pydantic error as ``source: a.b[2].c: message``."""
    errors = err.errors()
    e = max(errors, key=lambda x: len(x["loc"]))  # in a union, the member that got furthest
    loc = ""
    for part in e["loc"]:
        if isinstance(part, str) and (part in _UNION_TAGS or "-" in part or "[" in part):
            continue  # the member of a union that failed ('constrained-float'), not a field
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    msg = e["msg"].removeprefix("Value error, ")
    return f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}"


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})",
                key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


class InputFileError(ValueError):
    """An input file that cannot be read as YAML; the message is one line."""


def read_yaml(path: str | Path, what: str = "file") -> object:
    """A YAML input file as data: missing, binary and non-UTF-8 files, bad YAML and
    duplicate keys all raise ``InputFileError`` with one line naming the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory, not a {what}") from None
    except OSError as err:
        raise InputFileError(f"{path}: cannot read ({err.strerror})") from None
    try:
        if b"\0" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{path}: not a text file (byte {err.start}: {err.reason})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        first = " ".join(str(err).split())
        raise InputFileError(f"{path}: not valid YAML ({first[:160]})") from None


class ServerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    gpu: str | None = Field(None, description="GPU class of the catalogue (hetroute.hardware)")
    gpu_tflops: float | None = Field(None, ge=1e-3, le=10_000,
                                     description="F_n, dense FP16 tensor TFLOPS (default: the class's)")
    pcie_gb_s: float | None = Field(None, ge=1e-3, le=1_000,
                                    description="beta_n, GPU-CPU GB/s per direction (default: the class's)")
    gpu_mem_gb: float | None = Field(None, ge=1e-3, le=10_000, description="G_n, GPU memory GB")
    mem_bw_gb_s: float | None = Field(None, ge=1e-3, le=100_000, description="peak GPU memory GB/s")
    cpu_mem_gb: float = Field(ge=1e-3, le=100_000, description="C_n, CPU memory (GB)")
    derived: str | None = Field(None, description="written by resolved(): fields taken from a class")

    @model_validator(mode="after")
    def _class_or_numbers(self) -> "ServerSpec":
        if self.gpu is not None:
            try:
                gpu_class(self.gpu)
            except HardwareError as err:
                raise ValueError(f"gpu: {err}") from None
            return self
        for f in ("gpu_tflops", "pcie_gb_s", "gpu_mem_gb"):
            if getattr(self, f) is None:
                raise ValueError(f"{f}: required when no gpu class is named")
        return self

    def resolved(self) -> "ServerSpec":
        """Every number filled in; ``derived`` names what came from which class."""
        if self.gpu is not None:
            g = gpu_class(self.gpu)
            taken = [f for f in ("gpu_tflops", "pcie_gb_s", "gpu_mem_gb", "mem_bw_gb_s")
                     if getattr(self, f) is None]
            note = f"{', '.join(taken)} from class {g.name}" if taken else None
        else:
            g = nearest_class(self.gpu_tflops, self.gpu_mem_gb)
            taken = ["mem_bw_gb_s"] if self.mem_bw_gb_s is None else []
            note = f"mem_bw_gb_s from nearest class {g.name} (no gpu class named)" if taken else None
        return self.model_copy(update={
            "gpu_tflops": self.gpu_tflops or g.fp16_tflops, "pcie_gb_s": self.pcie_gb_s or g.pcie_gb_s,
            "gpu_mem_gb": self.gpu_mem_gb or g.mem_gb, "mem_bw_gb_s": self.mem_bw_gb_s or g.mem_bw_gb_s,
            "derived": note})

    def hardware_class(self):
        """The catalogue class whose ALU rate and weight formats this server has."""
        return gpu_class(self.gpu) if self.gpu is not None else nearest_class(
            self.gpu_tflops, self.gpu_mem_gb)


class LinkSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    src: str
    dst: str
    bandwidth_gbps: float = Field(gt=0, le=400)
    delay_ms: float = Field(ge=0, le=10_000)
    symmetric: bool = False


class TopologySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    description: str = ""
    generator: dict | None = None  # provenance of generated files
    servers: list[ServerSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cover_every_pair(self) -> "TopologySpec":
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError("server names must be unique")
        known = set(names)
        seen: dict[tuple[str, str], int] = {}
        for i, ln in enumerate(self.links):
            for end in (ln.src, ln.dst):
                if end not in known:
                    raise ValueError(f"links[{i}] names unknown server {end!r}")
            if ln.src == ln.dst:
                raise ValueError(f"links[{i}] joins {ln.src!r} to itself")
            pairs = [(ln.src, ln.dst)] + ([(ln.dst, ln.src)] if ln.symmetric else [])
            for p in pairs:
                if p in seen:
                    raise ValueError(f"links[{i}] repeats {p[0]}->{p[1]} (see links[{seen[p]}])")
                seen[p] = i
        for a in names:
            for b in names:
                if a != b and (a, b) not in seen:
                    raise ValueError(f"no link {a}->{b}: every ordered pair needs one")
        return self

    def link(self, src: str, dst: str) -> LinkSpec:
        for ln in self.links:
            if (ln.src, ln.dst) == (src, dst) or (ln.symmetric and (ln.dst, ln.src) == (src, dst)):
                return ln
        raise KeyError((src, dst))

    def warnings(self) -> list[str]:
        """Numbers that load but lie far (10x) outside every GPU of the catalogue or any
        real WAN link: most likely a unit slip (MB for GB, s for ms); one line each."""
        out = []
        for i, s in enumerate(self.servers):
            r = s.resolved()
            for f, attr in (("gpu_tflops", "fp16_tflops"), ("mem_bw_gb_s", "mem_bw_gb_s"),
                            ("pcie_gb_s", "pcie_gb_s"), ("gpu_mem_gb", "mem_gb")):
                vals = [getattr(c, attr) for c in CATALOGUE.values()]
                lo, hi = min(vals), max(vals)
                v = getattr(r, f)
                if v is not None and not lo / 10 <= v <= hi * 10:
                    out.append(f"servers[{i}].{f}: {v:g} is far outside real GPUs "
                               f"({lo:g}-{hi:g} in the catalogue)")
        for i, ln in enumerate(self.links):
            if ln.bandwidth_gbps < 0.01:
                out.append(f"links[{i}].bandwidth_gbps: {ln.bandwidth_gbps:g} Gbit/s is below "
                           f"10 Mbit/s (the paper's links are 0.8-10)")
            if ln.delay_ms > 1_000:
                out.append(f"links[{i}].delay_ms: {ln.delay_ms:g} ms one way is over a second "
                           f"(the paper's are 0.3-22 ms)")
        return out

    def resolved(self) -> "TopologySpec":
        """This topology with every server's numbers filled in (written next to results)."""
        return self.model_copy(update={"servers": [s.resolved() for s in self.servers]})

    def to_cluster(self) -> Cluster:
        servers = [s.resolved() for s in self.servers]
        classes = [s.hardware_class() for s in self.servers]
        names = tuple(s.name for s in self.servers)
        idx = {n: i for i, n in enumerate(names)}
        N = len(names)
        bw = [[0.0] * N for _ in range(N)]
        dl = [[0.0] * N for _ in range(N)]
        for ln in self.links:
            pairs = [(ln.src, ln.dst)] + ([(ln.dst, ln.src)] if ln.symmetric else [])
            for a, b in pairs:
                bw[idx[a]][idx[b]] = ln.bandwidth_gbps * 1e9 / 8
                dl[idx[a]][idx[b]] = ln.delay_ms * 1e-3
        for i in range(N):
            bw[i][i] = float("inf")
        return Cluster(
            names=names,
            flops=tuple(s.gpu_tflops * 1e12 for s in servers),
            pcie=tuple(s.pcie_gb_s * 1e9 for s in servers),
            gpu_bytes=tuple(s.gpu_mem_gb * 1e9 for s in servers),
            cpu_bytes=tuple(s.cpu_mem_gb * 1e9 for s in servers),
            bandwidth=tuple(tuple(r) for r in bw),
            delay=tuple(tuple(r) for r in dl),
            gpu_class=tuple(s.gpu or "custom" for s in self.servers),
            mem_bw=tuple(s.mem_bw_gb_s * 1e9 for s in servers),
            alu_flops=tuple(g.alu_tflops * 1e12 for g in classes),
            precisions=tuple(g.precisions for g in classes),
            derived=tuple(s.derived or "" for s in servers),
        )

    def to_yaml(self) -> str:
        """YAML with one line per server and per link."""
        d = self.model_dump(exclude_none=True)
        head = {k: v for k, v in d.items() if k not in ("servers", "links")}
        out = yaml.safe_dump(head, sort_keys=False, default_flow_style=None)
        for key in ("servers", "links"):
            out += f"{key}:\n"
            for item in d[key]:
                if key == "links" and not item.get("symmetric"):
                    item.pop("symmetric", None)
                out += "  - " + yaml.safe_dump(item, sort_keys=False, default_flow_style=True,
                                               width=10_000).strip() + "\n"
        return out


def parse_topology(data: object, source: str = "<topology>") -> TopologySpec:
    try:
        return TopologySpec.model_validate(data)
    except ValidationError as err:
        raise TopologyError(one_line(err, source)) from None


def load_topology(path: str | Path) -> TopologySpec:
    """Load a topology by path, or by bare name from the shipped ones (``paper10``)."""
    p = Path(path)
    if not p.exists() and p.suffix == "" and (Path(__file__).parent / f"{p.name}.yaml").exists():
        p = Path(__file__).parent / f"{p.name}.yaml"
    try:
        data = read_yaml(p, "topology file")
    except InputFileError as err:
        raise TopologyError(str(err).replace(str(p), str(path), 1)) from None
    return parse_topology(data, p.name)

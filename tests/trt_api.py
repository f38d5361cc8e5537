"""A stand-in ``tensorrt`` module generated from TensorRT's documented Python API (tests/fixtures/tensorrt_api.json).

The fixture records, per TensorRT major version (10.x, 11.x), the classes, methods with their parameter
names, properties and enum members of the Python bindings, each with the NVIDIA source it was read from.
:func:`make_tensorrt` builds a module from it whose objects

* accept only what the fixture lists for that version: any other attribute, method or enum member raises
  :class:`UndocumentedError` (an ``AttributeError``, as the real bindings raise) and is recorded in
  ``StandIn.undocumented``, so a ``getattr``/``hasattr`` probe cannot hide it from a test;
* bind every call against the documented parameters with :class:`inspect.Signature` (positional and
  keyword, overloads tried in turn), so a misspelt keyword or a missing argument is a ``TypeError``;
* record every call (``StandIn.calls``) and behave as the documentation says where unroll relies on it:
  a profile must cover every dynamic input within min ≤ opt ≤ max, ``build_serialized_network`` returns
  ``None`` (and logs an error through the caller's logger) when it does not, a timing cache from another
  TensorRT version is refused unless ``ignore_mismatch``, the context refuses input shapes outside the
  profile, and so on.

The "engine" a stand-in build serializes names the ONNX it runs; its execution context reads the inputs
from the addresses given to ``set_tensor_address``, runs ONNX Runtime on that graph (or on a perturbed copy,
``perturb=``, to show that the parity gate fails) and writes the outputs to their addresses. Nothing here
proves that the real TensorRT behaves so; the ``gpu`` tests do that where a GPU is present.
"""

from __future__ import annotations

import ctypes
import enum
import inspect
import json
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tensorrt_api.json"
_DEFAULT = object()  # a documented parameter with a default (its value is TensorRT's business)


class UndocumentedError(AttributeError):
    """An attribute, method or enum member that the fixture does not list for this TensorRT version."""


def load_fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def surface(major: str) -> dict:
    """The documented surface of TensorRT ``major`` ("10" or "11"): ``{"classes", "enums", "sources"}``,
    with a version that ``extends`` another resolved through its ``remove`` and ``enum_values``."""
    fx = load_fixture()
    spec = fx["versions"][major]
    if "extends" not in spec:
        return {"classes": json.loads(json.dumps(spec["classes"])), "enums": json.loads(json.dumps(spec["enums"])),
                "sources": fx["sources"], "tensorrt": spec["tensorrt"]}
    base = surface(spec["extends"])
    rm = spec.get("remove", {})
    for name, what in rm.get("enum_members", {}).items():
        e = base["enums"][name]
        e["members"] = [m for m in e["members"] if m not in what["members"]]
        e["values"] = {k: v for k, v in e.get("values", {}).items() if k not in what["members"]}
    for name in rm.get("enums", {}):
        del base["enums"][name]
    for cname, what in rm.get("members", {}).items():
        c = base["classes"][cname]
        for n in what["names"]:
            c.get("methods", {}).pop(n, None)
            c.get("properties", {}).pop(n, None)
    for name, what in spec.get("enum_values", {}).items():
        base["enums"][name]["values"] = {**base["enums"][name].get("values", {}), **what["values"]}
    base["tensorrt"] = spec["tensorrt"]
    return base


def signature(params: list[str]) -> inspect.Signature:
    """The documented parameters as a Signature (``name=`` has a default)."""
    return inspect.Signature([inspect.Parameter(p.rstrip("="), inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=_DEFAULT if p.endswith("=") else inspect.Parameter.empty)
                              for p in params])


# --------------------------------------------------------------------------------------------- the module


@dataclass
class StandIn:
    """What a stand-in module saw: every call with its bound arguments, and every undocumented name touched."""

    version: str
    major: str
    calls: list[tuple[str, dict]] = field(default_factory=list)
    undocumented: list[str] = field(default_factory=list)
    perturb: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
    workdir: Path | None = None
    logger: Any = None
    module: Any = None
    enum_types: dict[str, type[enum.IntEnum]] = field(default_factory=dict)
    proxies: dict[str, type] = field(default_factory=dict)

    def called(self, name: str) -> list[dict]:
        """The bound arguments of every call of ``Class.method`` (or ``Class.prop=`` for property writes)."""
        return [args for n, args in self.calls if n == name]

    def say(self, severity: str, msg: str) -> None:
        """Log through the caller's logger, as TensorRT does (the override is called positionally)."""
        if self.logger is not None:
            self.logger.log(getattr(self.enum_types["ILogger.Severity"], severity), msg)

    def new(self, cname: str, sim: Any) -> Any:
        """A proxy of ``cname`` around ``sim``, made by TensorRT (not by the caller)."""
        obj = object.__new__(self.proxies[cname])
        object.__setattr__(obj, "_standin_sim", sim)
        return obj

    def enum(self, name: str) -> type[enum.IntEnum]:
        return self.enum_types[name]

    def strongly_typed(self, flags: int) -> bool:
        if self.major != "10":
            return True  # 11.x: always (STRONGLY_TYPED is accepted and ignored)
        return bool(flags & (1 << int(self.enum("NetworkDefinitionCreationFlag").STRONGLY_TYPED)))


class _EnumNamespace:
    """An enum as the bindings expose it: members as attributes; anything else is undocumented."""

    def __init__(self, world: StandIn, qualname: str, cls: type[enum.IntEnum]) -> None:
        object.__setattr__(self, "_world", world)
        object.__setattr__(self, "_qualname", qualname)
        object.__setattr__(self, "_cls", cls)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._cls[name]
        except KeyError:
            self._world.undocumented.append(f"{self._qualname}.{name}")
            raise UndocumentedError(f"{self._qualname} has no member {name!r} in TensorRT {self._world.version} "
                                    f"(documented: {', '.join(self._cls.__members__)})") from None

    def __iter__(self):
        return iter(self._cls)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._qualname} is read-only")


def _enum_class(qualname: str, spec: dict) -> type[enum.IntEnum]:
    values = dict(spec.get("values", {}))
    used = set(values.values())
    nxt = 0
    for m in spec["members"]:
        if m not in values:
            while nxt in used:
                nxt += 1
            values[m] = nxt
            used.add(nxt)
    return enum.IntEnum(qualname.replace(".", "_"), [(m, values[m]) for m in spec["members"]])


def _proxy_class(world: StandIn, cname: str, spec: dict, base: type | None) -> type:
    methods = {m: [signature(p) for p in overloads] for m, overloads in spec.get("methods", {}).items()}
    props = dict(spec.get("properties", {}))
    inits = [signature(p) for p in spec["init"]] if "init" in spec else None
    subclassable = bool(spec.get("subclassable"))
    version = world.version

    def _undocumented(what: str, kind: str = "attribute") -> UndocumentedError:
        world.undocumented.append(f"{cname}.{what}")
        return UndocumentedError(f"TensorRT {version}: {cname} has no documented {kind} {what!r}")

    def _bind(qual: str, sigs: list[inspect.Signature], args: tuple, kwargs: dict) -> dict:
        errors = []
        for sig in sigs:
            try:
                return dict(sig.bind(*args, **kwargs).arguments)
            except TypeError as e:
                errors.append(f"{qual}{sig}: {e}")
        world.undocumented.append(f"{qual}(call matching no documented signature)")
        raise TypeError(f"TensorRT {version}: {qual}() called with args={args!r} kwargs={kwargs!r}, which match no "
                        f"documented signature: " + "; ".join(errors))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if inits is None:
            raise TypeError(f"tensorrt.{cname}: No constructor defined!")
        bound = _bind(f"{cname}.__init__", inits, args, kwargs)
        world.calls.append((f"{cname}.__init__", bound))
        sim_cls = SIMULATORS.get(cname)
        sim = sim_cls(world, self, **bound) if sim_cls is not None else None
        object.__setattr__(self, "_standin_sim", sim)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_standin_sim":
            raise AttributeError(name)
        sim = self.__dict__.get("_standin_sim") if hasattr(self, "__dict__") else None
        if name in methods:
            qual = f"{cname}.{name}"

            def call(*args: Any, **kwargs: Any) -> Any:
                bound = _bind(qual, methods[name], args, kwargs)
                world.calls.append((qual, bound))
                impl = getattr(sim, name, None)
                if impl is None:
                    raise NotImplementedError(f"{qual} is documented but the stand-in does not simulate it")
                try:
                    inspect.signature(impl).bind(**bound)
                except TypeError:
                    raise NotImplementedError(f"{qual}({', '.join(bound)}) is a documented overload the stand-in "
                                              "does not simulate") from None
                return impl(**bound)

            return call
        if name in props:
            if props[name] == "w":
                raise _undocumented(name, "readable property")
            if not hasattr(type(sim), name) and not hasattr(sim, name):
                raise NotImplementedError(f"{cname}.{name} is documented but the stand-in does not simulate it")
            return getattr(sim, name)
        raise _undocumented(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if subclassable and type(self) not in world.proxies.values():  # the caller's own subclass keeps its state
            object.__setattr__(self, name, value)
            return
        if name not in props:
            raise _undocumented(name)
        if "w" not in props[name]:
            raise _undocumented(name, "writable property")
        world.calls.append((f"{cname}.{name}=", {"value": value}))
        setattr(self.__dict__["_standin_sim"], name, value)

    ns: dict[str, Any] = {"__init__": __init__, "__getattr__": __getattr__, "__setattr__": __setattr__,
                          "__module__": "tensorrt", "__qualname__": cname}
    for dunder in spec.get("dunder", []):
        ns[dunder] = (lambda d: lambda self, *a: getattr(self.__dict__["_standin_sim"], d)(*a))(dunder)
    cls = type(cname, (base,) if base is not None else (), ns)
    for ename, espec in spec.get("enums", {}).items():
        qual = f"{cname}.{ename}"
        ecls = _enum_class(qual, espec)
        world.enum_types[qual] = ecls
        type.__setattr__(cls, ename, _EnumNamespace(world, qual, ecls))
        if espec.get("export_values"):
            for m in ecls:
                type.__setattr__(cls, m.name, m)
    return cls


def make_tensorrt(version: str, perturb: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
                  workdir: Path | None = None) -> tuple[types.ModuleType, StandIn]:
    """A ``tensorrt`` module of TensorRT ``version`` (e.g. ``"10.13.3.9"``) and the record of what it saw.

    ``perturb``: the engine a build serializes runs ``perturb(graph)`` instead of the graph (saved in
    ``workdir``), standing in for an engine that computes something else.
    """
    major = version.split(".")[0]
    api = surface(major)
    world = StandIn(version, major, perturb=perturb, workdir=workdir)
    mod = types.ModuleType("tensorrt")
    mod.__version__ = version
    pending = dict(api["classes"])
    while pending:  # bases first
        for cname, spec in list(pending.items()):
            if spec.get("base") in pending:
                continue
            world.proxies[cname] = _proxy_class(world, cname, spec, world.proxies.get(spec.get("base")))
            setattr(mod, cname, world.proxies[cname])
            del pending[cname]
    for ename, espec in api["enums"].items():
        ecls = _enum_class(ename, espec)
        world.enum_types[ename] = ecls
        setattr(mod, ename, _EnumNamespace(world, ename, ecls))

    def module_getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        world.undocumented.append(f"tensorrt.{name}")
        raise UndocumentedError(f"TensorRT {version} has no documented module attribute {name!r}")

    mod.__getattr__ = module_getattr
    world.module = mod
    return mod, world


# --------------------------------------------------------------------------------------------- simulation

_ONNX_TO_TRT = {onnx.TensorProto.FLOAT: "FLOAT", onnx.TensorProto.FLOAT16: "HALF", onnx.TensorProto.BFLOAT16: "BF16",
                onnx.TensorProto.INT8: "INT8", onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64",
                onnx.TensorProto.BOOL: "BOOL", onnx.TensorProto.UINT8: "UINT8"}
_TRT_TO_NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
                 "BOOL": np.bool_, "UINT8": np.uint8}
_PLAN_MAGIC = "unroll-standin-plan"
_CACHE_MAGIC = b"unroll-standin-timing-cache "


def _dims(value: Any, what: str) -> tuple[int, ...]:
    """Dims as the bindings take them: a tuple or list of ints (implicitly converted)."""
    if not isinstance(value, tuple | list) or not all(isinstance(v, int | np.integer) for v in value):
        raise TypeError(f"{what}: expected Dims (a tuple or list of ints), got {value!r}")
    return tuple(int(v) for v in value)


def _member(world: StandIn, enum_name: str, value: Any, what: str) -> enum.IntEnum:
    cls = world.enum(enum_name)
    if not isinstance(value, cls):
        raise TypeError(f"{what}: incompatible function arguments; expected tensorrt.{enum_name}, got {value!r}")
    return value


def _proxy_of(world: StandIn, cname: str, value: Any, what: str) -> Any:
    if not isinstance(value, world.proxies[cname]):
        raise TypeError(f"{what}: incompatible function arguments; expected tensorrt.{cname}, got {type(value)}")
    return value.__dict__["_standin_sim"]


class _Logger:
    def __init__(self, world: StandIn, proxy: Any) -> None:
        pass


class _HostMemory:
    def __init__(self, world: StandIn, blob: bytes) -> None:
        self.blob = bytes(blob)
        self.dtype = world.enum("DataType").UINT8
        self.nbytes = len(self.blob)

    def __bytes__(self) -> bytes:
        return self.blob


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any, is_input: bool) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self.is_network_input, self.is_network_output = is_input, not is_input


class _Network:
    def __init__(self, world: StandIn, flags: int) -> None:
        self.world, self.flags = world, flags
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self.path: str | None = None
        self.name = "network"
        self.num_layers = 0

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, index: int) -> Any:
        return self.inputs[index] if 0 <= index < len(self.inputs) else None

    def get_output(self, index: int) -> Any:
        return self.outputs[index] if 0 <= index < len(self.outputs) else None


class _ParserError:
    def __init__(self, world: StandIn, code: str, desc: str, node: int = -1, node_name: str = "",
                 node_operator: str = "") -> None:
        self._code, self._desc = world.enum("ErrorCode")[code], desc
        self._node, self._node_name, self._node_operator = node, node_name, node_operator

    def code(self) -> Any:
        return self._code

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._node_name

    def node_operator(self) -> str:
        return self._node_operator


class _OnnxParser:
    def __init__(self, world: StandIn, proxy: Any, network: Any, logger: Any) -> None:
        self.world = world
        self.network = _proxy_of(world, "INetworkDefinition", network, "OnnxParser(network)")
        if not isinstance(logger, world.proxies["ILogger"]):
            raise TypeError("OnnxParser(logger): expected tensorrt.ILogger")
        self.errors: list[Any] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> Any:
        return self.errors[index] if 0 <= index < len(self.errors) else None

    def clear_errors(self) -> None:
        self.errors.clear()

    def parse_from_file(self, model: str) -> bool:
        if not isinstance(model, str):
            raise TypeError(f"OnnxParser.parse_from_file(model): expected str, got {type(model)}")
        w = self.world
        try:
            graph = onnx.load(model)
        except Exception as e:
            self.errors.append(w.new("ParserError", _ParserError(w, "MODEL_DESERIALIZE_FAILED", str(e))))
            return False
        for i, n in enumerate(graph.graph.node):
            if n.domain not in ("", "ai.onnx"):
                self.errors.append(w.new("ParserError", _ParserError(
                    w, "UNSUPPORTED_NODE", f"No importer registered for op: {n.op_type}", i, n.name, n.op_type)))
        if self.errors:
            return False
        dtype = w.enum("DataType")
        inits = {t.name for t in graph.graph.initializer}

        def tensor(v: onnx.ValueInfoProto, is_input: bool) -> Any:
            shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                          for d in v.type.tensor_type.shape.dim)
            return w.new("ITensor", _Tensor(v.name, shape, dtype[_ONNX_TO_TRT[v.type.tensor_type.elem_type]], is_input))

        self.network.inputs = [tensor(v, True) for v in graph.graph.input if v.name not in inits]
        self.network.outputs = [tensor(v, False) for v in graph.graph.output]
        self.network.path = model
        self.network.num_layers = len(graph.graph.node)
        w.say("INFO", f"stand-in: parsed {model}")
        return True


class _Profile:
    def __init__(self, world: StandIn) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.extra_memory_target = 1.0

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002 (documented names)
        lo, mid, hi = (_dims(v, f"IOptimizationProfile.set_shape({k})") for k, v in
                       (("min", min), ("opt", opt), ("max", max)))
        if not (len(lo) == len(mid) == len(hi)) or not all(0 <= a <= b <= c for a, b, c in zip(lo, mid, hi,
                                                                                                 strict=True)):
            raise RuntimeError("Shape provided for min is inconsistent with other shapes.")
        self.shapes[str(input)] = (lo, mid, hi)

    def get_shape(self, input: str) -> list:  # noqa: A002
        return list(self.shapes.get(input, ()))

    def __bool__(self) -> bool:
        return bool(self.shapes)


class _TimingCache:
    def __init__(self, world: StandIn, version: str) -> None:
        self.world, self.version = world, version

    def serialize(self) -> Any:
        return self.world.new("IHostMemory", _HostMemory(self.world, _CACHE_MAGIC + self.version.encode()))


class _BuilderConfig:
    def __init__(self, world: StandIn) -> None:
        self.world = world
        self.pools: dict[Any, int] = {}
        self.flag_set = {world.enum("BuilderFlag").TF32}  # "Enabled by default"
        self.profiles: list[_Profile] = []
        self.cache: Any = None
        self._level = 3

    @property
    def builder_optimization_level(self) -> int:
        return self._level

    @builder_optimization_level.setter
    def builder_optimization_level(self, value: int) -> None:
        if not isinstance(value, int) or not 0 <= value <= 5:
            raise TypeError(f"builder_optimization_level must be an int in 0…5, got {value!r}")
        self._level = value

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
        pool = _member(self.world, "MemoryPoolType", pool, "set_memory_pool_limit(pool)")
        if not isinstance(pool_size, int) or pool_size < 0:
            raise TypeError(f"set_memory_pool_limit(pool_size): expected a size in bytes, got {pool_size!r}")
        self.pools[pool] = pool_size

    def get_memory_pool_limit(self, pool: Any) -> int:
        return self.pools.get(_member(self.world, "MemoryPoolType", pool, "get_memory_pool_limit(pool)"), 0)

    def clear_flag(self, flag: Any) -> None:
        self.flag_set.discard(_member(self.world, "BuilderFlag", flag, "clear_flag(flag)"))

    def set_flag(self, flag: Any) -> None:
        self.flag_set.add(_member(self.world, "BuilderFlag", flag, "set_flag(flag)"))

    def get_flag(self, flag: Any) -> bool:
        return _member(self.world, "BuilderFlag", flag, "get_flag(flag)") in self.flag_set

    def add_optimization_profile(self, profile: Any) -> int:
        p = _proxy_of(self.world, "IOptimizationProfile", profile, "add_optimization_profile(profile)")
        if not p:
            self.world.say("ERROR", "stand-in: the optimization profile is not valid")
            return -1
        self.profiles.append(p)
        return len(self.profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: Any) -> Any:
        if not isinstance(serialized_timing_cache, bytes | bytearray | memoryview):
            raise TypeError("create_timing_cache(serialized_timing_cache): expected a buffer")
        blob = bytes(serialized_timing_cache)
        version = blob[len(_CACHE_MAGIC):].decode(errors="replace") if blob.startswith(_CACHE_MAGIC) else (
            self.world.version if not blob else "unknown")
        return self.world.new("ITimingCache", _TimingCache(self.world, version))

    def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
        c = _proxy_of(self.world, "ITimingCache", cache, "set_timing_cache(cache)")
        if not isinstance(ignore_mismatch, bool):
            raise TypeError("set_timing_cache(ignore_mismatch): expected bool")
        if c.version != self.world.version and not ignore_mismatch:
            return False
        self.cache = cache
        return True

    def get_timing_cache(self) -> Any:
        return self.cache


class _Builder:
    def __init__(self, world: StandIn, proxy: Any, logger: Any) -> None:
        if not isinstance(logger, world.proxies["ILogger"]):
            raise TypeError(f"Builder(logger): incompatible function arguments; expected tensorrt.ILogger, got "
                            f"{type(logger)}")
        self.world = world
        world.logger = logger
        world.say("INFO", "stand-in: builder created")

    def create_network(self, flags: int = 0) -> Any:
        if not isinstance(flags, int) or flags < 0:
            raise TypeError(f"create_network(flags): expected a bit mask (int), got {flags!r}")
        return self.world.new("INetworkDefinition", _Network(self.world, flags))

    def create_builder_config(self) -> Any:
        return self.world.new("IBuilderConfig", _BuilderConfig(self.world))

    def create_optimization_profile(self) -> Any:
        return self.world.new("IOptimizationProfile", _Profile(self.world))

    def _fail(self, msg: str) -> None:
        self.world.say("ERROR", msg)

    def build_serialized_network(self, network: Any, config: Any, kernel_text: Any = None) -> Any:
        w = self.world
        net = _proxy_of(w, "INetworkDefinition", network, "build_serialized_network(network)")
        cfg = _proxy_of(w, "IBuilderConfig", config, "build_serialized_network(config)")
        if net.path is None:
            return self._fail("stand-in: the network has no inputs (nothing was parsed)")
        inputs = {t.name: t.shape for t in (i.__dict__["_standin_sim"] for i in net.inputs)}
        dynamic = [n for n, s in inputs.items() if any(d < 0 for d in s)]
        if dynamic and not cfg.profiles:
            return self._fail("Network has dynamic or shape inputs, but no optimization profile has been defined.")
        profile = cfg.profiles[0].shapes if cfg.profiles else {}
        for name in profile:
            if name not in inputs:
                return self._fail(f"stand-in: the optimization profile sets {name!r}, which is no network input")
        for name, shape in inputs.items():
            if name not in profile:
                if name in dynamic:
                    return self._fail(f"{name}: dynamic input is missing dimensions in profile 0.")
                continue
            for which, dims in zip(("min", "opt", "max"), profile[name], strict=True):
                if len(dims) != len(shape) or any(s >= 0 and d != s for d, s in zip(dims, shape, strict=True)):
                    return self._fail(f"{name}: profile {which} {list(dims)} does not fit the input's shape "
                                      f"{list(shape)}")
        run = net.path
        if w.perturb is not None:
            if w.workdir is None:
                raise ValueError("a perturbed stand-in needs workdir=")
            model = w.perturb(onnx.load(net.path))
            run = str(Path(w.workdir) / f"perturbed-{len(w.calls)}.onnx")
            onnx.save(model, run)
        plan = {"magic": _PLAN_MAGIC, "tensorrt": w.version, "onnx": run, "source": net.path,
                "strongly_typed": w.strongly_typed(net.flags),
                "profile": {n: [list(d) for d in s] for n, s in profile.items()},
                "inputs": {t.name: [list(t.shape), t.dtype.name] for t in (i.__dict__["_standin_sim"]
                                                                           for i in net.inputs)},
                "outputs": {t.name: [list(t.shape), t.dtype.name] for t in (o.__dict__["_standin_sim"]
                                                                            for o in net.outputs)}}
        return w.new("IHostMemory", _HostMemory(w, json.dumps(plan).encode()))


class _Runtime:
    def __init__(self, world: StandIn, proxy: Any, logger: Any) -> None:
        if not isinstance(logger, world.proxies["ILogger"]):
            raise TypeError("Runtime(logger): expected tensorrt.ILogger")
        self.world = world
        world.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: Any) -> Any:  # the buffer overload (not the stream readers)
        try:
            plan = json.loads(bytes(serialized_engine))
            assert plan["magic"] == _PLAN_MAGIC
        except Exception:
            self.world.say("ERROR", "stand-in: not a serialized engine")
            return None
        if plan["tensorrt"] != self.world.version:
            self.world.say("ERROR", f"stand-in: the plan was built by TensorRT {plan['tensorrt']}")
            return None
        return self.world.new("ICudaEngine", _Engine(self.world, plan))


class _Engine:
    def __init__(self, world: StandIn, plan: dict) -> None:
        self.world, self.plan = world, plan
        self.names = [*plan["inputs"], *plan["outputs"]]
        self._session = None

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def _ort(self) -> Any:
        if self._session is None:
            import onnxruntime as ort

            self._session = ort.InferenceSession(self.plan["onnx"], providers=["CPUExecutionProvider"])
        return self._session

    def get_tensor_name(self, index: int) -> str | None:
        return self.names[index] if 0 <= index < len(self.names) else None

    def get_tensor_mode(self, name: str) -> Any:
        mode = self.world.enum("TensorIOMode")
        return mode.INPUT if name in self.plan["inputs"] else mode.OUTPUT if name in self.plan["outputs"] else mode.NONE

    def _io(self, name: str) -> list:
        return self.plan["inputs"].get(name) or self.plan["outputs"][name]

    def get_tensor_dtype(self, name: str) -> Any:
        return self.world.enum("DataType")[self._io(name)[1]]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._io(name)[0])

    def create_execution_context(self, strategy: Any = None) -> Any:  # the strategy overload (not runtime_config)
        if strategy is not None:
            _member(self.world, "ExecutionContextAllocationStrategy", strategy, "create_execution_context(strategy)")
        return self.world.new("IExecutionContext", _Context(self.world, self))


class _Context:
    def __init__(self, world: StandIn, engine: _Engine) -> None:
        self.world, self.engine = world, engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: Any) -> bool:
        shape = _dims(shape, "set_input_shape(shape)")
        if name not in self.engine.plan["inputs"]:
            self.world.say("ERROR", f"stand-in: {name!r} is no input tensor")
            return False
        lo, _, hi = self.engine.plan["profile"].get(name, [self.engine.get_tensor_shape(name)] * 3)
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)):
            self.world.say("ERROR", f"IExecutionContext::setInputShape: {name} {list(shape)} is outside the "
                                    f"profile's [{lo}, {hi}]")
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not isinstance(memory, int) or memory <= 0:
            raise TypeError(f"set_tensor_address(memory): expected a device address (int), got {memory!r}")
        if name not in self.engine.names:
            self.world.say("ERROR", f"stand-in: {name!r} is no I/O tensor")
            return False
        self.addresses[name] = memory
        return True

    def _output_shapes(self) -> dict[str, tuple[int, ...]]:
        from unroll.export.trt_memory import infer_shapes

        shapes, _ = infer_shapes(onnx.load(self.engine.plan["onnx"]), self.shapes)
        return {n: shapes[n][1] for n in self.engine.plan["outputs"] if n in shapes}

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if name in self.engine.plan["inputs"]:
            return self.shapes.get(name, self.engine.get_tensor_shape(name))
        if set(self.shapes) != set(self.engine.plan["inputs"]):
            return self.engine.get_tensor_shape(name)
        return self._output_shapes().get(name, self.engine.get_tensor_shape(name))

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError(f"execute_async_v3(stream_handle): expected an int, got {stream_handle!r}")
        eng = self.engine
        missing = [n for n in eng.names if n not in self.addresses] + [n for n in eng.plan["inputs"]
                                                                      if n not in self.shapes]
        if missing:
            self.world.say("ERROR", f"IExecutionContext::enqueueV3: tensors without address or shape: {missing}")
            return False
        feeds = {}
        for n in eng.plan["inputs"]:
            dt = np.dtype(_TRT_TO_NUMPY[eng.plan["inputs"][n][1]])
            shape = self.shapes[n]
            nbytes = int(np.prod(shape)) * dt.itemsize
            buf = (ctypes.c_char * nbytes).from_address(self.addresses[n])
            feeds[n] = np.frombuffer(buf, dtype=dt).reshape(shape).copy()
        outs = eng._ort().run(list(eng.plan["outputs"]), feeds)
        for n, arr in zip(eng.plan["outputs"], outs, strict=True):
            arr = np.ascontiguousarray(arr.astype(_TRT_TO_NUMPY[eng.plan["outputs"][n][1]]))
            ctypes.memmove(self.addresses[n], arr.ctypes.data, arr.nbytes)
        return True


#: Which class each documented class is simulated by (constructible classes get ``(world, proxy, **args)``).
SIMULATORS: dict[str, type] = {"ILogger": _Logger, "Builder": _Builder, "OnnxParser": _OnnxParser,
                               "Runtime": _Runtime}
#: The simulated behaviour of objects TensorRT hands out (for the fixture-consistency test).
HANDED_OUT: dict[str, type] = {"IBuilderConfig": _BuilderConfig, "IOptimizationProfile": _Profile,
                               "INetworkDefinition": _Network, "ITensor": _Tensor, "ParserError": _ParserError,
                               "ITimingCache": _TimingCache, "IHostMemory": _HostMemory, "ICudaEngine": _Engine,
                               "IExecutionContext": _Context}

"""Checkpoints of whole training states: nested dicts, lists and tuples of tensors, arrays and scalars.

A state is flattened into blobs (one per tensor, array or bytes leaf, named by
its key path joined by "/") and a tree that records everything else; the tree
travels in the manifest's meta under the reserved key "pacer"
({"schema": "pacer.state/1", "tree": ...}). Tree nodes are JSON: None, bools,
strings, int64-range ints, finite floats and lists stand for themselves; every
other value is an object with a type tag "t".
"""
import collections
import concurrent.futures
import datetime
import io
import itertools
import json
import math
import os
import queue
import random
import socket
import sys
import threading
import types
import warnings

import numpy as np

from ._pacer import Error, HostBuffer, _Checkpointer, _advise_huge_pages, _export_safetensors, _prefault, _prune, built_with_mpi, \
    dtype_size

SCHEMA = "pacer.state/1"
META_KEY = "pacer"
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what the manifest's JSON keeps exactly
_SHOWN_KEYS = 5

Loaded = collections.namedtuple("Loaded", "step state meta")
Loaded.__doc__ = ("What Checkpointer.load returns: the step, the state (the `into` object when given) and the "
                  "user's meta.")


class _Mismatch(Error):
    """The checkpoint does not fit the structure given to load(into=...): not a bad copy, no fallback."""


class _Collective(Error):
    """The ranks of a load could not share what they read, or agree on a step: not a bad copy, no fallback."""


class _Elsewhere(Error):
    """Another rank cannot use this candidate (yet): this rank tries it again or skips it, as the ranks agreed."""


def _torch():
    """torch when the program uses it; pacer never imports it for numpy-only states."""
    return sys.modules.get("torch")


def _where(path):
    return "state" + "".join(f"[{k!r}]" for k in path)


def _dtensor_type():
    torch = _torch()
    if torch is None:
        return None
    for mod in ("torch.distributed.tensor", "torch.distributed._tensor"):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, "DTensor"):
            return m.DTensor
    return None


class Shard:
    """Rows [offset, offset + len(tensor)) of a tensor of `global_shape` that several ranks hold in parts.

    Saved as this rank's byte range of the logical tensor; loading into a Shard
    reads its rows whatever the world size at save time was, so a checkpoint
    written by N ranks loads at any other number of ranks. `tensor` is a torch
    tensor or a numpy array; sharding is along the first dimension.
    """

    def __init__(self, tensor, offset, global_shape):
        self.tensor = tensor
        self.offset = int(offset)
        self.global_shape = [int(d) for d in global_shape]
        shape = list(tensor.shape)
        if not shape or not self.global_shape or shape[1:] != self.global_shape[1:]:
            raise Error(f"Shard: a {shape} shard does not fit a {self.global_shape} tensor along its first dimension")
        if self.offset < 0 or self.offset + shape[0] > self.global_shape[0]:
            raise Error(f"Shard: rows [{self.offset}, {self.offset + shape[0]}) lie outside "
                        f"{self.global_shape[0]} rows")

    @classmethod
    def _part(cls, tensor, offset, global_shape, skip=False):
        """A DTensor's local part, trusted as torch placed it; `skip`: another rank writes these rows."""
        s = cls.__new__(cls)
        s.tensor, s.offset, s.global_shape, s.skip = tensor, offset, list(global_shape), skip
        return s

    skip = False

    def __repr__(self):
        return f"pacer.Shard(rows {self.offset}..{self.offset + self.tensor.shape[0]} of {self.global_shape})"


class PerRank:
    """A value that differs between ranks (each rank's RNG states, its own counters), saved per rank.

    Every rank passes a PerRank at the same place of its state; each rank's
    value (any state: dicts, tensors, scalars) is stored as that rank's own,
    and a load gives each rank back the value it saved. Replicated state must
    hold the same bytes on every rank; this is for what does not. Loading at
    another world size fails for a rank that saved nothing there.
    """

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"pacer.PerRank({self.value!r})"


def _per_rank_tree_name(prefix, rank):
    return f"{prefix}/rank-{rank}.tree"


# ---- naming the leaves --------------------------------------------------------


def _dtype_name(x):
    """The blob dtype of a tensor or array (numpy names, bfloat16, float8_*)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    return "bool" if x.dtype == np.bool_ else x.dtype.name


def _what(x):
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.LambdaType,
                      types.BuiltinMethodType)) or type(x).__name__ == "method-wrapper":
        return "a function"
    if isinstance(x, io.IOBase):
        return "an open file"
    if isinstance(x, types.ModuleType):
        return "a module"
    if isinstance(x, types.GeneratorType):
        return "a generator"
    return f"an object of type {type(x).__module__}.{type(x).__qualname__}"


_DEFAULT_FACTORIES = {"int": int, "float": float, "list": list, "dict": dict, "str": str, "set": set}


class _Flattener:
    """Turns a state into (tree, blobs); keeps what the blobs point into alive until save() returns."""

    def __init__(self):
        self.blobs = []  # (name, data, dtype, shape, layout, shard_offset, global_size, global_shape)
        self.names = set()
        self.keep = []
        self.cuda_devices = []
        self.active = set()  # containers on the current path: a state that contains itself cannot be saved
        self.rank = 0
        self.in_per_rank = False

    def name_for(self, path):
        base = "/".join(str(k) for k in path) or "~"
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}~{i}"
        self.names.add(name)
        return name

    def key(self, k, path):
        if k is None or isinstance(k, (bool, str)):
            return k
        if isinstance(k, int):
            return self.scalar(int(k))
        if isinstance(k, float):
            return self.scalar(float(k))
        if isinstance(k, tuple) and type(k) is tuple:
            return {"t": "tuple", "items": [self.key(x, path) for x in k]}
        raise Error(f"{_where(path)}: a dict key {k!r} of type {type(k).__name__} cannot be saved "
                    "(str, int, float, bool, None and tuples of them can)")

    @staticmethod
    def scalar(v):
        if isinstance(v, int):
            return v if _INT_MIN <= v <= _INT_MAX else {"t": "int", "v": hex(v)}  # hex: no digit limit
        if math.isfinite(v):
            return v
        return {"t": "float", "v": repr(v)}  # 'nan', 'inf', '-inf'

    def node(self, x, path):
        torch = _torch()
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, np.generic):
            return self.numpy_scalar(x, path)
        if isinstance(x, int):
            return self.scalar(int(x))
        if isinstance(x, float):
            return self.scalar(float(x))
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise Error(f"{_where(path)}: a string that is not valid UTF-8 cannot be saved: {e}") from None
            return str(x)
        if isinstance(x, (bytes, bytearray, memoryview)):
            raw = memoryview(x).cast("B") if isinstance(x, memoryview) else x
            name = self.name_for(path)
            data = np.frombuffer(raw, dtype=np.uint8) if len(raw) else np.zeros(0, np.uint8)
            self.keep.append(data)
            self.blobs.append((name, data, "bytes", [len(data)], "replicated", 0, 0, []))
            return {"t": "bytearray" if isinstance(x, bytearray) else "bytes", "blob": name}
        if isinstance(x, Shard):
            return self.array(x.tensor, path, shard=x)
        if isinstance(x, PerRank):
            return self.per_rank(x, path)
        if isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor)):
            return self.array(x, path)
        if torch is not None:
            if isinstance(x, torch.Size):
                return {"t": "size", "v": [int(d) for d in x]}
            if isinstance(x, torch.dtype):
                return {"t": "dtype", "v": str(x).replace("torch.", "")}
            if isinstance(x, torch.device):
                return {"t": "device", "v": str(x)}
        if isinstance(x, (dict, list, tuple)):
            if id(x) in self.active:
                raise Error(f"{_where(path)}: the state contains itself")
            self.active.add(id(x))
            try:
                return self.container(x, path)
            finally:
                self.active.discard(id(x))
        raise Error(f"{_where(path)}: cannot save {_what(x)}")

    def per_rank(self, x, path):
        """This rank's value under names only it writes: each blob a shard that is the whole of its own blob,
        and the value's tree a bytes blob beside them (the state's tree, rank 0's, holds only the node)."""
        if self.in_per_rank:
            raise Error(f"{_where(path)}: a PerRank inside a PerRank")
        prefix = self.name_for(path)
        tree_name = _per_rank_tree_name(prefix, self.rank)
        self.names.add(tree_name)
        start = len(self.blobs)
        self.in_per_rank = True
        try:
            sub = self.node(x.value, path + (f"rank-{self.rank}",))
        finally:
            self.in_per_rank = False
        for i in range(start, len(self.blobs)):
            name, data, dtype, shape, layout, _, _, _ = self.blobs[i]
            if layout != "replicated":
                raise Error(f"{_where(path)}: a Shard or DTensor inside a PerRank (each rank's value is its own)")
            nbytes = data[2] if isinstance(data, tuple) else data.nbytes
            self.blobs[i] = (name, data, dtype, shape, "shard", 0, nbytes, list(shape))
        raw = np.frombuffer(json.dumps(sub, allow_nan=False).encode(), dtype=np.uint8)
        self.keep.append(raw)
        self.blobs.append((tree_name, raw, "bytes", [raw.nbytes], "shard", 0, raw.nbytes, [raw.nbytes]))
        return {"t": "perrank", "prefix": prefix}

    def container(self, x, path):
        if isinstance(x, dict):
            items = [[self.key(k, path), self.node(v, path + (k,))] for k, v in x.items()]
            if type(x) is dict:
                return {"t": "dict", "items": items}
            if type(x) is collections.OrderedDict:
                out = {"t": "odict", "items": items}
                md = getattr(x, "_metadata", None)  # nn.Module.state_dict()'s per-module versions
                if md is not None:
                    out["metadata"] = self.node(md, path + ("_metadata",))
                return out
            if type(x) is collections.Counter:
                return {"t": "counter", "items": items}
            if type(x) is collections.defaultdict:
                factory = next((n for n, f in _DEFAULT_FACTORIES.items() if x.default_factory is f), None)
                if x.default_factory is None or factory is not None:
                    return {"t": "defaultdict", "factory": factory, "items": items}
                raise Error(f"{_where(path)}: cannot save a defaultdict whose default_factory is "
                            f"{_what(x.default_factory)}; pass dict(x)")
            raise Error(f"{_where(path)}: cannot save a {type(x).__qualname__} (a dict subclass); pass dict(x)")
        if isinstance(x, list):
            if type(x) is not list:
                raise Error(f"{_where(path)}: cannot save a {type(x).__qualname__} (a list subclass); pass list(x)")
            return [self.node(v, path + (i,)) for i, v in enumerate(x)]
        if type(x) is not tuple:
            raise Error(f"{_where(path)}: cannot save a {type(x).__qualname__} (a tuple subclass); pass tuple(x)")
        return {"t": "tuple", "items": [self.node(v, path + (i,)) for i, v in enumerate(x)]}

    def numpy_scalar(self, x, path):
        if x.dtype.kind not in "biufc" or not dtype_size(_dtype_name(x)):
            raise Error(f"{_where(path)}: a numpy scalar of dtype {x.dtype} cannot be saved (numbers and bools only)")
        a = np.asarray(x)
        a = a.astype(a.dtype.newbyteorder("<"))
        return {"t": "npscalar", "dtype": _dtype_name(x), "hex": a.tobytes().hex()}

    def array(self, x, path, shard=None):
        torch = _torch()
        dtensor = _dtensor_type()
        layout, shard_offset, global_size, global_shape = "replicated", 0, 0, []
        if dtensor is not None and isinstance(x, dtensor):
            local, rows, gshape, skip = _dtensor_part(x, path)
            if rows is None:  # Replicate() on every mesh dimension: the whole tensor, on every rank
                x = local
            else:
                shard = Shard._part(local, rows, gshape, skip)
        if shard is not None:
            x = shard.tensor
        is_torch = torch is not None and isinstance(x, torch.Tensor)
        if is_torch:
            data, dtype, shape = self.tensor_bytes(x, path)
            kind = "tensor"
        else:
            data, dtype, shape = self.numpy_bytes(np.asarray(x), path)
            kind = "ndarray"
        node = {"t": kind, "dtype": dtype, "shape": shape}
        if shard is not None:
            row_bytes = dtype_size(dtype) * int(np.prod(shard.global_shape[1:], dtype=np.int64))
            layout, shard_offset = "shard", shard.offset * row_bytes
            global_size = row_bytes * shard.global_shape[0]
            global_shape = list(shard.global_shape)
            node["shape"] = global_shape
            node["layout"] = "shard"
        name = self.name_for(path)
        node["blob"] = name
        if shard is None or not shard.skip:
            self.blobs.append((name, data, dtype, shape, layout, shard_offset, global_size, global_shape))
        return node

    def tensor_bytes(self, t, path):
        torch = _torch()
        dtype = _dtype_name(t)
        if t.layout != torch.strided:
            raise Error(f"{_where(path)}: cannot save a {t.layout} tensor (dense tensors only; call .to_dense())")
        if t.is_quantized or not dtype_size(dtype):
            raise Error(f"{_where(path)}: cannot save a tensor of dtype {t.dtype}")
        if t.device.type == "meta":
            raise Error(f"{_where(path)}: a tensor on the meta device has no data to save")
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.device.type not in ("cpu", "cuda"):
            t = t.cpu()
        t = t.contiguous()
        shape = [int(d) for d in t.shape]
        self.keep.append(t)
        if t.device.type == "cuda":
            if t.device not in self.cuda_devices:
                self.cuda_devices.append(t.device)
            nbytes = t.numel() * t.element_size()
            return (t.device.index, t.data_ptr() if nbytes else 0, nbytes), dtype, shape
        return t.reshape(-1).view(torch.uint8).numpy(), dtype, shape

    def numpy_bytes(self, a, path):
        dtype = _dtype_name(a)
        if a.dtype.kind not in "biufc" or not dtype_size(dtype):
            raise Error(f"{_where(path)}: numpy dtype {a.dtype} cannot be saved (numbers and bools only; "
                        "use bytes for the rest)")
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))  # stored little-endian, as the manifest's dtype says
        if not a.flags.c_contiguous:  # (ascontiguousarray would make a 0-d array 1-d)
            a = np.ascontiguousarray(a)
        self.keep.append(a)
        return a.reshape(-1).view(np.uint8), dtype, [int(d) for d in a.shape]


def _dtensor_part(x, path):
    """(local tensor, first global row or None when replicated, global shape, skip) of a DTensor.

    Shard(0) and Replicate() placements only. Ranks whose coordinate along a
    Replicate() mesh dimension is not 0 hold a copy of a shard another rank
    writes: they skip it.
    """
    placements = tuple(x.placements)
    mesh = x.device_mesh
    shard_dims = [i for i, p in enumerate(placements) if not p.is_replicate()]
    for p in placements:
        if not p.is_replicate() and not p.is_shard(dim=0):
            raise Error(f"{_where(path)}: cannot save a DTensor placed as {placements}: only Shard(0) and "
                        "Replicate() are supported (redistribute it, or save x.full_tensor())")
    local = x.to_local()
    if not shard_dims:
        return local, None, None, False
    if len(shard_dims) > 1:
        raise Error(f"{_where(path)}: cannot save a DTensor sharded along dimension 0 over several mesh "
                    f"dimensions {placements}")
    coord = mesh.get_coordinate()
    skip = coord is None or any(coord[i] != 0 for i, p in enumerate(placements) if p.is_replicate())
    rows = _dtensor_rows(x, path)
    return local, rows, [int(d) for d in x.shape], skip


def _dtensor_rows(x, path):
    """The first global row of a Shard(0) DTensor's local part."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        try:
            from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
        except ImportError:
            compute_local_shape_and_global_offset = None
    if compute_local_shape_and_global_offset is not None:
        _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        return int(offset[0])
    # torch.chunk's split, which Shard(0) uses: ceil(n / parts) rows per part.
    placements = tuple(x.placements)
    dim = next(i for i, p in enumerate(placements) if not p.is_replicate())
    parts = x.device_mesh.size(dim)
    coord = x.device_mesh.get_coordinate()[dim]
    per = -(-x.shape[0] // parts)
    return min(coord * per, x.shape[0])


# ---- reading back -------------------------------------------------------------


class _Bad(Error):
    """The stored tree is not one this version wrote: a bad copy."""


def _decode_key(k):
    if k is None or isinstance(k, (bool, str, int, float)):
        return k
    if isinstance(k, dict) and k.get("t") in ("int", "float"):
        return _decode_scalar(k)
    if isinstance(k, dict) and k.get("t") == "tuple" and isinstance(k.get("items"), list):
        return tuple(_decode_key(x) for x in k["items"])
    raise _Bad(f"bad dict key {k!r} in the stored state")


def _decode_scalar(n):
    try:
        if n["t"] == "int":
            return int(n["v"], 16)
        v = float(n["v"])
        if math.isfinite(v):
            raise ValueError(n["v"])
        return v
    except (KeyError, TypeError, ValueError):
        raise _Bad(f"bad number {n!r} in the stored state") from None


def _items(n):
    items = n.get("items")
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
        raise _Bad(f"bad {n.get('t')} node in the stored state")
    return items


def _torch_dtype(name, path):
    torch = _torch()
    if torch is None:
        import torch  # noqa: F811 - a checkpoint of torch tensors loads torch
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise _Bad(f"{_where(path)}: torch {torch.__version__} has no dtype '{name}'")
    return dt


class _Plan:
    """The reads that one load makes, run in parallel once the whole structure is checked."""

    def __init__(self, reader, map_location, rank=0):
        self.reader = reader
        self.rank = rank
        self.specs = {name: (dtype, list(shape), size) for name, dtype, shape, size in reader.blobs()}
        self.map_location = map_location
        self.host = []     # (blob, uint8 numpy view, offset)
        self.device = []   # (blob, uint8 flat CUDA tensor, offset)
        self.after = []    # callables run once every read succeeded: copies out of temporaries, assignments
        cb = reader.chunk_bytes or (64 << 20)
        self.piece = max(cb, ((64 << 20) // cb) * cb)  # whole chunks: each chunk is read and checked once
        self.claimed = set()  # blobs a node has taken: each is saved for one leaf
        self.bytes_read = self.bytes_alone = self.bytes_received = 0  # what run() read, alone, and got from others

    def claim(self, name, path):
        """A stored tree naming one blob twice would have it allocated and read once per mention."""
        if name in self.claimed:
            raise _Bad(f"{_where(path)}: the stored state names blob {name!r} a second time")
        self.claimed.add(name)

    # -- the blob behind a tensor node
    def blob(self, n, path):
        name = n.get("blob")
        if name not in self.specs:
            raise _Bad(f"{_where(path)}: the stored state names blob {name!r}, which the checkpoint lacks")
        self.claim(name, path)
        dtype, shape, size = self.specs[name]
        want_shape = n.get("shape")
        if dtype != n.get("dtype") or want_shape != shape:
            raise _Bad(f"{_where(path)}: blob {name!r} is {dtype} {shape}, the stored state says "
                       f"{n.get('dtype')} {want_shape}")
        if any(d < 0 for d in shape) or (dtype != "bytes" and
                                         int(np.prod(shape, dtype=object)) * dtype_size(dtype) != size):
            raise _Bad(f"{_where(path)}: blob {name!r} has {size} bytes, not those of {dtype} {shape}")
        return name, dtype, shape, size

    def read_host(self, name, buf, offset=0):
        if buf.nbytes:
            self.host.append((name, buf, offset))

    def read_device(self, name, flat, offset=0):
        if flat.numel():
            self.device.append((name, flat, offset))

    # -- building values that are not there yet
    def build(self, n, path):
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        if isinstance(n, list):
            return [self.build(v, path + (i,)) for i, v in enumerate(n)]
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            raise _Bad(f"{_where(path)}: bad node {str(n)[:80]} in the stored state")
        t = n["t"]
        if t in ("dict", "odict", "counter", "defaultdict"):
            items = _items(n)
            pairs = []
            for k, v in items:
                key = _decode_key(k)
                pairs.append((key, self.build(v, path + (key,))))
            if t == "dict":
                return dict(pairs)
            if t == "counter":
                return collections.Counter(dict(pairs))
            if t == "defaultdict":
                factory = n.get("factory")
                if factory is not None and factory not in _DEFAULT_FACTORIES:
                    raise _Bad(f"{_where(path)}: unknown default_factory {factory!r}")
                return collections.defaultdict(_DEFAULT_FACTORIES.get(factory), pairs)
            out = collections.OrderedDict(pairs)
            if "metadata" in n:
                out._metadata = self.build(n["metadata"], path + ("_metadata",))
            return out
        if t == "tuple":
            items = n.get("items")
            if not isinstance(items, list):
                raise _Bad(f"{_where(path)}: bad tuple node in the stored state")
            return tuple(self.build(v, path + (i,)) for i, v in enumerate(items))
        if t in ("int", "float"):
            return _decode_scalar(n)
        if t == "npscalar":
            try:
                a = np.frombuffer(bytes.fromhex(n["hex"]), dtype=np.dtype(n["dtype"]).newbyteorder("<"))
                return a.astype(a.dtype.newbyteorder("="))[0]
            except (KeyError, TypeError, ValueError, IndexError):
                raise _Bad(f"{_where(path)}: bad numpy scalar in the stored state") from None
        if t in ("bytes", "bytearray"):
            name = n.get("blob")
            if name not in self.specs or self.specs[name][0] != "bytes":
                raise _Bad(f"{_where(path)}: the stored state names bytes blob {name!r}, which the checkpoint lacks")
            self.claim(name, path)
            size = self.specs[name][2]
            buf = bytearray(size)
            self.read_host(name, np.frombuffer(buf, dtype=np.uint8) if size else np.zeros(0, np.uint8))
            if t == "bytearray":
                return buf
            holder = [None]
            self.after.append(lambda: holder.__setitem__(0, bytes(buf)))
            return _Later(holder)
        if t in ("tensor", "ndarray"):
            return self.new_array(n, path)
        if t == "perrank":
            return self.build(self.per_rank_node(n, path), path + (f"rank-{self.rank}",))
        if t == "size":
            return _torch_size(n, path)
        if t == "dtype":
            return _torch_dtype(n.get("v"), path)
        if t == "device":
            torch = _torch() or __import__("torch")
            return torch.device(str(n.get("v")))
        raise _Bad(f"{_where(path)}: unknown node type {t!r} in the stored state (written by a newer pacer?)")

    def per_rank_node(self, n, path):
        """The tree of the value this rank saved under a PerRank node, read now (it is small)."""
        prefix = n.get("prefix")
        name = _per_rank_tree_name(prefix, self.rank) if isinstance(prefix, str) else None
        if name not in self.specs or self.specs[name][0] != "bytes":
            raise _Mismatch(f"{_where(path)}: saved per rank, and rank {self.rank} saved nothing here "
                            "(saved by fewer ranks?)")
        self.claim(name, path)
        size = self.specs[name][2]
        buf = bytearray(size)
        if size:
            self.reader.read_into(name, np.frombuffer(buf, dtype=np.uint8), 0)
        try:
            return json.loads(bytes(buf).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise _Bad(f"{_where(path)}: rank {self.rank}'s stored value is not a tree") from None

    def new_array(self, n, path):
        name, dtype, shape, size = self.blob(n, path)
        if n["t"] == "ndarray" or dtype == "bytes":
            np_dtype = np.dtype(np.uint8 if dtype == "bytes" else dtype)
            count = int(np.prod(shape, dtype=np.int64))
            buf = np.frombuffer(_new_host_buffer(size), dtype=np.uint8)[:size]
            self.read_host(name, buf)
            return buf.view(np_dtype)[:count].reshape(shape)
        torch = _torch() or __import__("torch")
        tdtype = _torch_dtype(dtype, path)
        device = torch.device(self.map_location) if self.map_location is not None else torch.device("cpu")
        if device.type == "cpu":
            host = torch.frombuffer(_new_host_buffer(size), dtype=torch.uint8)[:size]
            self.read_host(name, host.numpy())
            return host.view(tdtype).reshape(shape)
        out = torch.empty(shape, dtype=tdtype, device=device)
        if device.type == "cuda":
            self.read_device(name, out.reshape(-1).view(torch.uint8))
        else:
            host = torch.frombuffer(_new_host_buffer(size), dtype=torch.uint8)[:size]
            self.read_host(name, host.numpy())
            self.after.append(lambda: out.copy_(host.view(tdtype).reshape(shape)))
        return out

    # -- restoring into what the caller has
    def restore(self, n, target, path):
        """The value for `target`'s place: target itself, filled in place, or a new value."""
        if isinstance(n, dict) and n.get("t") == "perrank":
            sub = self.per_rank_node(n, path)
            inner = path + (f"rank-{self.rank}",)
            if isinstance(target, PerRank):
                value = self.restore(sub, target.value, inner)
                self.after.append(lambda: setattr(target, "value", _resolve(value)))
                return target
            return self.restore(sub, target, inner)
        if isinstance(target, PerRank):
            raise _Mismatch(f"{_where(path)}: a PerRank here, {_describe(n)} in the checkpoint")
        if _is_array(target):
            return self.fill(n, target, path)
        if isinstance(target, dict):
            if not (isinstance(n, dict) and n.get("t") in ("dict", "odict", "counter", "defaultdict")):
                return self.replace(n, target, path, "a dict")
            stored = {}
            for k, v in _items(n):
                key = _decode_key(k)
                stored[key] = v
            missing = [k for k in target if k not in stored and _holds_array(target[k])]
            extra = [k for k in stored if k not in target and target and _stores_array(stored[k])]
            if missing or extra:
                parts = []
                if missing:
                    parts.append(f"{_keys(missing)} here but not in the checkpoint")
                if extra:
                    parts.append(f"{_keys(extra)} in the checkpoint but not here")
                raise _Mismatch(f"{_where(path)}: keys do not match: " + "; ".join(parts))
            for key, v in stored.items():
                if key in target:
                    value = self.restore(v, target[key], path + (key,))
                else:
                    value = self.build(v, path + (key,))
                if key not in target or value is not target[key]:
                    self.after.append(lambda d=target, k=key, x=value: d.__setitem__(k, _resolve(x)))
            return target
        if isinstance(target, list):
            if not isinstance(n, list):
                return self.replace(n, target, path, "a list")
            if not _holds_array(target):
                value = self.build(n, path)
                self.after.append(lambda: target.__setitem__(slice(None), _resolve(value)))
                return target
            if len(n) != len(target):
                raise _Mismatch(f"{_where(path)}: {len(n)} items in the checkpoint, {len(target)} here")
            for i, v in enumerate(n):
                value = self.restore(v, target[i], path + (i,))
                if value is not target[i]:
                    self.after.append(lambda k=i, x=value: target.__setitem__(k, _resolve(x)))
            return target
        torch = _torch()
        if isinstance(target, tuple) and not (torch is not None and isinstance(target, torch.Size)) \
                and _holds_array(target):
            if not (isinstance(n, dict) and n.get("t") == "tuple" and isinstance(n.get("items"), list)):
                return self.replace(n, target, path, "a tuple")
            if len(n["items"]) != len(target):
                raise _Mismatch(f"{_where(path)}: {len(n['items'])} items in the checkpoint, {len(target)} here")
            return tuple(self.restore(v, t, path + (i,)) for i, (v, t) in enumerate(zip(n["items"], target)))
        return self.build(n, path)

    def replace(self, n, target, path, what):
        if _holds_array(target):
            raise _Mismatch(f"{_where(path)}: {what} of tensors here, {_describe(n)} in the checkpoint")
        return self.build(n, path)

    def fill(self, n, target, path):
        """Plans the reads that put node n's bytes into the existing tensor or array."""
        torch = _torch()
        if not (isinstance(n, dict) and n.get("t") in ("tensor", "ndarray")):
            raise _Mismatch(f"{_where(path)}: a tensor here, {_describe(n)} in the checkpoint")
        name, dtype, shape, size = self.blob(n, path)
        given = target
        shard = target if isinstance(target, Shard) else None
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(target, dtensor):
            local, rows, gshape, _ = _dtensor_part(target, path)
            if rows is None:
                target = local
            else:
                shard = Shard._part(local, rows, gshape)
        t = shard.tensor if shard is not None else target
        here_dtype = _dtype_name(t)
        if here_dtype != dtype and not (dtype == "bytes" and here_dtype == "uint8"):
            raise _Mismatch(f"{_where(path)}: dtype {dtype} in the checkpoint, {here_dtype} here")
        offset = 0
        local_shape = [int(d) for d in t.shape]
        if shard is not None:
            if list(shard.global_shape) != shape:
                raise _Mismatch(f"{_where(path)}: shape {shape} in the checkpoint, "
                                f"a shard of {shard.global_shape} here")
            row_bytes = dtype_size(dtype) * int(np.prod(shape[1:], dtype=np.int64))
            offset = shard.offset * row_bytes
        elif local_shape != shape:
            raise _Mismatch(f"{_where(path)}: shape {shape} in the checkpoint, {local_shape} here")
        nbytes = int(np.prod(local_shape, dtype=np.int64)) * dtype_size(dtype)
        if torch is not None and isinstance(t, torch.Tensor):
            t = t.detach()
            if t.device.type == "cuda" and t.is_contiguous():
                self.read_device(name, t.reshape(-1).view(torch.uint8), offset)
            elif t.device.type == "cpu" and t.is_contiguous():
                self.read_host(name, t.reshape(-1).view(torch.uint8).numpy(), offset)
            else:
                tmp = torch.frombuffer(_new_host_buffer(nbytes), dtype=torch.uint8)[:nbytes]
                self.read_host(name, tmp.numpy(), offset)
                self.after.append(lambda: t.copy_(tmp.view(t.dtype).reshape(t.shape)))
            return given
        if not t.flags.writeable:
            raise _Mismatch(f"{_where(path)}: the array here is read-only")
        if t.flags.c_contiguous and t.dtype.isnative:
            self.read_host(name, t.reshape(-1).view(np.uint8), offset)
        else:
            tmp = np.frombuffer(_new_host_buffer(nbytes), dtype=np.uint8)[:nbytes]
            self.read_host(name, tmp, offset)
            self.after.append(lambda: np.copyto(t, tmp.view(t.dtype.newbyteorder("=")).reshape(t.shape)))
        return given

    # -- running
    def run(self, shared=None):
        """Every planned read, in parallel (the reads release the GIL), each byte checked as it arrives.

        `shared` (a _SharedLoad, several ranks): the pieces every rank reads
        alike are read once, each by one rank, and broadcast to the others.
        """
        jobs = [(name, buf, offset, lo, min(self.piece, buf.nbytes - lo))
                for name, buf, offset in self.host for lo in range(0, buf.nbytes, self.piece)]
        workers = max(1, min(4, os.cpu_count() or 1, len(jobs) + len(self.device)))
        dev = _DeviceCopies(self, workers) if self.device else None
        dev_jobs = list(dev.jobs()) if dev is not None else []
        exchange = None if shared is None else shared.divide(self.reader.step, jobs, dev_jobs)
        # From here to the exchange's all_ok every failure must reach the other ranks, which wait in it.
        try:
            if exchange is not None:
                jobs, dev_jobs = exchange.mine(jobs, dev_jobs)
            self.bytes_read = sum(j[4] for j in jobs) + sum(j[4] for j in dev_jobs)
            self.bytes_alone = self.bytes_read - (0 if exchange is None else exchange.owned)
            self._read(jobs, dev, dev_jobs, workers)
        except BaseException:
            if exchange is not None:
                exchange.failed()
            raise
        if exchange is not None:
            exchange.finish(self.reader.step)
            self.bytes_received = exchange.received
        for f in self.after:
            f()

    def _read(self, jobs, dev, dev_jobs, workers):
        # Small blobs travel together (a few groups per worker), so that a state
        # of thousands of small tensors is not thousands of thread hand-offs.
        per_group = max(1, -(-len(jobs) // (4 * workers)))
        groups, group, group_bytes = [], [], 0
        for j in jobs:
            if group and (len(group) == per_group or group_bytes + j[4] > self.piece):
                groups.append(group)
                group, group_bytes = [], 0
            group.append(j)
            group_bytes += j[4]
        if group:
            groups.append(group)
        # More threads (_FAULTERS) fault the destinations in, group by group in
        # the order the groups are read, ahead of the readers: a reader whose
        # destination is new memory otherwise faults it in (slow on a VM,
        # where each first touch goes to the host) before its read goes out,
        # while the disk idles (bench/results/ckpt_load_alloc-2026-12-01.md).
        ready, stop, faulters = None, threading.Event(), []
        if len(groups) > 1 and sum(j[4] for j in jobs) >= _PREFAULT_FROM:
            ready = [threading.Event() for _ in groups]
            order = itertools.count()  # the next group to fault; next() on it is atomic under the GIL
            for _ in range(min(_FAULTERS, len(groups))):
                faulters.append(threading.Thread(target=self._fault_ahead, args=(groups, ready, stop, order),
                                                 daemon=True))
                faulters[-1].start()
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(self._read_host, g, ready[i] if ready else None) for i, g in enumerate(groups)]
            futures += [pool.submit(dev.copy, *j) for j in dev_jobs]
            try:
                for f in concurrent.futures.as_completed(futures):
                    f.result()
            except BaseException:
                stop.set()
                for f in futures:
                    f.cancel()
                raise
            finally:
                stop.set()
                for t in faulters:
                    t.join()

    @staticmethod
    def _fault_ahead(groups, ready, stop, order):
        """One of the faulting threads: takes the next group in reading order until none is left."""
        try:
            while not stop.is_set():
                i = next(order)
                if i >= len(groups):
                    return
                for _, buf, _, lo, n in groups[i]:
                    if not _prefault(buf[lo:lo + n]):
                        stop.set()  # the kernel cannot: the readers fault their own
                        return
                ready[i].set()
        except BaseException:
            stop.set()
            raise
        finally:
            if stop.is_set():  # no reader may wait for a group nobody will fault
                for done in ready:
                    done.set()

    def _read_host(self, group, ready=None):
        if ready is not None:
            ready.wait()
        for name, buf, offset, lo, n in group:
            self.reader.read_into(name, buf[lo:lo + n], offset + lo)


class _SharedLoad:
    """One load() by every rank of a Checkpointer over several ranks.

    Replicated state (DDP: every rank loads the same tensors) would otherwise
    be read whole by every rank: N times the bytes from the filesystem, and
    on one node N O_DIRECT readers of the same file. Instead the pieces that
    every rank reads alike are divided between the ranks, each read (and
    checked) once, and broadcast (CUDA tensors over the job's NCCL group;
    over gloo only with _SHARE_OVER_GLOO).

    The ranks go through their candidates in rounds, so that every rank
    resumes from the same step although their lists may differ (a listing
    that raced a commit, a node-local copy the others lack). Per round every
    rank calls gather_all once: (step, piece keys) when it planned its
    candidate, (step, None) when the candidate failed to plan, None when it
    stops (nothing left, or an error). When all planned one step, all_ok
    follows once after the reads, then the broadcasts. Otherwise, and when a
    rank's reads failed, the floor is the lowest step any rank is at: a rank
    whose candidate failed moves to its next one, a rank above the floor to
    its first candidate at or below it, and a rank that could use its
    candidate at the floor tries it again. A rank that stops makes every rank
    raise: none resumes from a step that another does not.
    """

    def __init__(self, comm):
        self.comm = comm
        self.active = True  # still in rounds with the other ranks
        self.used = False  # the last candidate was read in parts and exchanged
        self.floor = None  # the newest step every rank may still resume from
        self.stay = False  # try the same candidate again: another rank failed, not this one
        self.why = None    # why another rank could not use this rank's current step

    def _agree(self, everyone):
        """Every rank's view of this round; raises when one stopped or the collective failed."""
        if everyone is None:
            self.active = False
            raise _Collective(f"the ranks could not agree on a step to load: {self.comm.broken}")
        stopped = [r for r, e in enumerate(everyone) if e is None]
        if stopped:
            self.active = False
            raise _Collective(f"rank {stopped[0]} stopped loading (no valid checkpoint left, or an error there; "
                              "see its output): no rank resumes alone")
        self.floor = min(e[0] for e in everyone)

    def stop(self):
        """This rank leaves the rounds (nothing left, or an error): the others hear of it and raise."""
        if self.active:
            self.active = False
            self.comm.gather_all(None)

    def plan_failed(self, step):
        """This rank could not plan its candidate at `step`: it moves to its next one."""
        self.used = self.stay = False
        if self.active:
            self._agree(self.comm.gather_all((step, None)))

    def skip_to(self, candidates, i):
        """The index of the candidate to try after candidates[i] failed here or elsewhere."""
        if self.stay:
            return i
        step = candidates[i].step
        i += 1
        while i < len(candidates) and self.floor is not None and candidates[i].step > self.floor:
            c = candidates[i]
            warnings.warn(f"pacer: skipping step {c.step} in {c.dir}: not every rank can load it "
                          f"(another rank is at step {self.floor})")
            i += 1
        if i < len(candidates) and candidates[i].step != step:
            self.why = None
        return i

    def divide(self, step, jobs, dev_jobs):
        """An _Exchange when every rank planned this step; else raises _Elsewhere (try again, or skip)."""
        self.used = self.stay = False
        if not self.active:
            return None
        host = _SHARE_OVER_GLOO
        device = _SHARE_OVER_GLOO or self.comm.data_backend() == "nccl"
        keys = [("h", j[0], j[2] + j[3], j[4]) for j in jobs if host and j[4] >= _SHARE_FROM] + \
               [("d", j[0], j[2] + j[3], j[4]) for j in dev_jobs if device and j[4] >= _SHARE_FROM]
        everyone = self.comm.gather_all((step, keys))
        self._agree(everyone)
        if any(e[0] != step or e[1] is None for e in everyone):
            self.stay = step == self.floor  # another rank's candidate failed, or it is at an older step
            raise _Elsewhere(self.why or f"another rank cannot load step {step} (it is at step {self.floor})")
        common = set(keys)
        for e in everyone:
            common &= {tuple(k) for k in e[1]}
        owners, taken = {}, [0] * self.comm.size()
        for k in sorted(common):  # the same order on every rank, so the same owners
            r = min(range(len(taken)), key=lambda i: (taken[i], i))
            owners[k] = r
            taken[r] += k[3]
        return _Exchange(self, owners)


class _Exchange:
    """The pieces of one load that each rank reads for all, and their broadcast."""

    def __init__(self, load, owners):
        self.load = load
        self.comm = load.comm
        self.owners = owners
        self.shared = []  # (key, owner, kind, target slice), in key order
        self.received = 0  # bytes the other ranks read for this one
        self.owned = 0     # bytes this rank reads for all

    def mine(self, jobs, dev_jobs):
        """This rank's reads: its own pieces and everything not shared."""
        me = self.comm.rank()
        out = ([], [])
        for kind, js, i in (("h", jobs, 0), ("d", dev_jobs, 1)):
            for j in js:
                key = (kind, j[0], j[2] + j[3], j[4])
                owner = self.owners.get(key)
                if owner is not None:
                    self.shared.append((key, owner, kind, j[1][j[3]:j[3] + j[4]]))
                    if owner != me:
                        self.received += j[4]
                        continue
                    self.owned += j[4]
                out[i].append(j)
        self.shared.sort(key=lambda x: x[0])
        return out

    def failed(self):
        """This rank's reads failed: every rank leaves the candidate; this one moves to its next."""
        self.comm.all_ok(False)

    def finish(self, step):
        """Broadcasts every shared piece from its reader; raises _Elsewhere when another rank's reads failed."""
        if not self.comm.all_ok(True):
            self.load.stay = True  # this rank's copy read fine: it is tried again unless the others move on
            self.load.why = f"another rank could not read its part of step {step}"
            raise _Elsewhere(self.load.why)
        # The ranks have agreed on this step: whatever happens next, none looks for another.
        self.load.active = False
        self.comm.broadcast_pieces([(owner, kind, part) for _, owner, kind, part in self.shared])
        self.load.used = bool(self.shared)


# Pieces smaller than this are read by every rank that needs them: a
# broadcast each would cost more than the read.
_SHARE_FROM = 1 << 20
# Whether pieces travel over gloo too (host memory, or CUDA tensors when the
# job's group is gloo). Off: gloo sends over TCP, and ranks that read for
# themselves were faster, on one node (parallel O_DIRECT readers) and with
# two ranks on one GPU (bench/results/ckpt-gpu-h200-2026-12-04/,
# ckpt_ranks-vm-2026-12-04.json). CUDA tensors over NCCL are always shared.
_SHARE_OVER_GLOO = False


# Loads smaller than this are not worth a faulting thread.
_PREFAULT_FROM = 64 << 20
# Threads that fault the destinations in, ahead of the readers. One: on the
# 2-core VM two made load() slower (3.07 s against 2.03 s, medians,
# bench/results/ckpt_load-2026-12-01.md), competing with the readers'
# checksumming for the cores; bench/ckpt_load.py compares both.
_FAULTERS = 1

# Whether new load destinations are advised as transparent huge pages before
# their first write (one fault and zeroing per 2 MiB instead of per 4 KiB).
# Off: on the 2-core VM a huge first touch measured slower than 4 KiB pages
# (bench/results/ckpt_load-2026-12-01.md); bench/ckpt_load.py compares both.
_LOAD_HUGE_PAGES = False


def _new_host_buffer(size):
    """Fresh page-aligned memory for a load destination (never written before the read)."""
    buf = HostBuffer(max(size, 1))
    if _LOAD_HUGE_PAGES:
        _advise_huge_pages(buf)
    return buf


class _DeviceCopies:
    """Reads for CUDA targets: into a few pinned buffers, copied to the device on side streams."""

    def __init__(self, plan, workers):
        import torch

        self.torch = torch
        self.plan = plan
        largest = max(flat.numel() for _, flat, _ in plan.device)
        self.piece = min(plan.piece, largest)
        self.pool = queue.Queue()
        for _ in range(workers + 1):
            self.pool.put(torch.empty(self.piece, dtype=torch.uint8, pin_memory=True))
        # The copies wait for the caller's streams, which may still be using the targets.
        self.after = {flat.device: torch.cuda.current_stream(flat.device) for _, flat, _ in plan.device}
        self.local = threading.local()

    def jobs(self):
        for name, flat, offset in self.plan.device:
            for lo in range(0, flat.numel(), self.piece):
                yield name, flat, offset, lo, min(self.piece, flat.numel() - lo)

    def copy(self, name, flat, offset, lo, n):
        torch = self.torch
        streams = getattr(self.local, "streams", None)
        if streams is None:
            streams = self.local.streams = {}
        s = streams.get(flat.device)
        if s is None:
            s = streams[flat.device] = torch.cuda.Stream(device=flat.device)
            s.wait_stream(self.after[flat.device])
        buf = self.pool.get()
        try:
            self.plan.reader.read_into(name, buf[:n].numpy(), offset + lo)
            with torch.cuda.stream(s):
                flat[lo:lo + n].copy_(buf[:n], non_blocking=True)
            s.synchronize()  # the buffer is reused next: the copy must have landed
        finally:
            self.pool.put(buf)


class _Later:
    """A value known only after the reads (bytes, tuples holding them)."""

    def __init__(self, holder):
        self.holder = holder

    def get(self):
        return self.holder[0]


def _resolve(x):
    """Replaces the _Later placeholders in a built value by what was read."""
    if isinstance(x, _Later):
        return x.get()
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, (_Later, dict, list, tuple)):
                x[k] = _resolve(v)
        return x
    if isinstance(x, list):
        for i, v in enumerate(x):
            if isinstance(v, (_Later, dict, list, tuple)):
                x[i] = _resolve(v)
        return x
    if type(x) is tuple and any(isinstance(v, (_Later, dict, list, tuple)) for v in x):
        return tuple(_resolve(v) for v in x)
    return x


def _torch_size(n, path):
    torch = _torch() or __import__("torch")
    v = n.get("v")
    if not isinstance(v, list) or not all(isinstance(d, int) for d in v):
        raise _Bad(f"{_where(path)}: bad torch.Size in the stored state")
    return torch.Size(v)


def _is_array(x):
    torch = _torch()
    return isinstance(x, (np.ndarray, Shard)) or (torch is not None and isinstance(x, torch.Tensor))


def _holds_array(x):
    if _is_array(x):
        return True
    if isinstance(x, dict):
        return any(_holds_array(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_array(v) for v in x)
    return False


def _stores_array(n):
    """Whether a stored node holds a tensor or array."""
    if isinstance(n, list):
        return any(_stores_array(v) for v in n)
    if not isinstance(n, dict):
        return False
    t, items = n.get("t"), n.get("items")
    if t in ("tensor", "ndarray"):
        return True
    if t == "tuple" and isinstance(items, list):
        return any(_stores_array(v) for v in items)
    if isinstance(items, list):
        return any(isinstance(i, list) and len(i) == 2 and _stores_array(i[1]) for i in items)
    return False


def _describe(n):
    if n is None:
        return "None"
    if isinstance(n, list):
        return f"a list of {len(n)}"
    if isinstance(n, dict):
        t = n.get("t")
        if t in ("tensor", "ndarray"):
            return f"a {n.get('dtype')} {t} of shape {n.get('shape')}"
        return {"dict": "a dict", "odict": "a dict", "tuple": "a tuple"}.get(t, f"a {t}")
    return f"a {type(n).__name__} ({n!r})"[:80]


def _keys(keys):
    shown = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    return shown + (f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else "")


def _flat_tree(reader):
    """The tree of a checkpoint saved by the flat API before pacer.state/1: {name: array}."""
    items = []
    for name, dtype, shape, _ in reader.blobs():
        kind = "tensor" if dtype == "bfloat16" else "ndarray"
        items.append([name, {"t": kind, "dtype": dtype, "shape": list(shape), "blob": name}])
    return {"t": "dict", "items": items}


# ---- several ranks ------------------------------------------------------------


class TorchCommunicator:
    """pacer's collectives (rank, size, barrier, all_ok, broadcast) over a gloo side group of `group`.

    Created collectively (torch.distributed.new_group) by every rank. The
    checkpoint's commit runs on its own gloo group so that it never queues
    behind the job's own (NCCL) collectives. Methods never raise: a failed or
    timed-out collective marks the communicator broken, all_ok() is False and
    broadcast() returns an error message on every receiving rank from then on,
    so that no rank commits or waits beyond `timeout` seconds.
    """

    def __init__(self, group=None, timeout=300.0):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        group = dist.group.WORLD if group is None else group
        self._ranks = sorted(dist.get_process_group_ranks(group))
        self._timeout = datetime.timedelta(seconds=float(timeout))
        self._group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=self._timeout)
        self._rank = self._ranks.index(dist.get_rank())
        self._broken = None
        # The job's own group (NCCL for GPU jobs) carries loaded device tensors between ranks.
        self._data_group = None if group is dist.group.WORLD else group

    def rank(self):
        return self._rank

    def size(self):
        return len(self._ranks)

    @property
    def broken(self):
        """Why a collective failed, or None."""
        return self._broken

    def _min(self, value):
        t = self._torch.tensor([int(value)], dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        return int(t.item())

    def _fail(self, what, e):
        if self._broken is None:
            self._broken = f"rank {self._rank}: torch.distributed {what} failed: {type(e).__name__}: {e}".strip()

    def barrier(self):
        self.all_ok(True)

    def all_ok(self, ok):
        if self._broken is not None:
            return False
        try:
            return self._min(1 if ok else 0) == 1
        except Exception as e:  # noqa: BLE001 - any failure is a failed collective
            self._fail("all_reduce", e)
            return False

    def broadcast(self, value, root):
        value = bytes(value)
        if self._broken is None:
            try:
                torch = self._torch
                n = torch.tensor([len(value)], dtype=torch.int64)
                self._dist.broadcast(n, src=self._ranks[root], group=self._group)
                size = int(n.item())
                if self._rank == root:
                    buf = torch.frombuffer(bytearray(value), dtype=torch.uint8) if size else None
                else:
                    buf = torch.empty(size, dtype=torch.uint8) if size else None
                if buf is not None:
                    self._dist.broadcast(buf, src=self._ranks[root], group=self._group)
                return value if self._rank == root else (bytes(buf.numpy()) if size else b"")
            except Exception as e:  # noqa: BLE001
                self._fail("broadcast", e)
        # The root keeps what it knows; the others must not take silence for success.
        return value if self._rank == root else self._broken.encode()

    def data_backend(self):
        """The backend of the job's group, which carries loaded CUDA tensors ("nccl", "gloo", ...)."""
        try:
            return str(self._dist.get_backend(self._data_group)).lower()
        except Exception:  # noqa: BLE001 - a group torch cannot name: treat as not NCCL
            return ""

    def gather_all(self, value):
        """Every rank's value (picklable), in rank order; None when the collective failed."""
        if self._broken is not None:
            return None
        out = [None] * len(self._ranks)
        try:
            self._dist.all_gather_object(out, value, group=self._group)
            return out
        except Exception as e:  # noqa: BLE001
            self._fail("all_gather_object", e)
            return None

    def broadcast_pieces(self, pieces):
        """Broadcasts each (root, kind, buffer) in place from its root: "h" numpy host memory over the gloo
        group, "d" CUDA tensors over the job's group. Raises pacer.Error when a broadcast fails."""
        dist, torch = self._dist, self._torch
        try:
            if self._broken is not None:
                raise RuntimeError(self._broken)
            works = []
            for root, kind, buf in pieces:
                if kind == "h":
                    t, group = torch.from_numpy(buf), self._group
                else:
                    t, group = buf, self._data_group
                works.append(dist.broadcast(t, src=self._ranks[root], group=group, async_op=True))
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001
            self._fail("broadcast", e)
            raise _Collective(f"rank {self._rank}: sharing the loaded bytes between ranks failed: "
                              f"{type(e).__name__}: {e}") from None

    def split_node(self):
        return self._split(socket.gethostname())

    def split(self, color):
        return self._split(int(color) if color >= 0 else None)

    def _split(self, key):
        """The ranks that passed the same key (None: none), as a new communicator; None where torch cannot."""
        dist = self._dist
        if self._broken is not None or len(self._ranks) != dist.get_world_size():
            return None  # new_group is collective over the whole world
        keys = [None] * len(self._ranks)
        try:
            dist.all_gather_object(keys, key, group=self._group)
        except Exception as e:  # noqa: BLE001
            self._fail("all_gather_object", e)
            return None
        mine = None
        for k in sorted({k for k in keys if k is not None}, key=keys.index):
            ranks = [self._ranks[i] for i, x in enumerate(keys) if x == k]
            sub = _SubCommunicator(self, ranks)  # every rank enters every new_group
            if k == key:
                mine = sub
        return mine


class _SubCommunicator(TorchCommunicator):
    def __init__(self, parent, ranks):
        self._torch, self._dist = parent._torch, parent._dist
        self._ranks = sorted(ranks)
        self._timeout = parent._timeout
        self._group = self._dist.new_group(ranks=self._ranks, backend="gloo", timeout=self._timeout)
        self._data_group = None
        me = self._dist.get_rank()
        self._rank = self._ranks.index(me) if me in self._ranks else -1
        self._broken = None

    def _split(self, key):
        return None


def _communicator(group, timeout):
    """What Checkpointer's collective commit runs over: a TorchCommunicator, "mpi", or None (one rank)."""
    torch = _torch()
    dist = getattr(torch, "distributed", None) if torch is not None else None
    initialised = dist is not None and dist.is_available() and dist.is_initialized()
    if group is not None:
        if isinstance(group, TorchCommunicator):
            return group
        if not initialised:
            raise Error("Checkpointer(group=...): torch.distributed is not initialised")
        return TorchCommunicator(group, timeout) if dist.get_world_size(group) > 1 else None
    if initialised:
        return TorchCommunicator(None, timeout) if dist.get_world_size() > 1 else None
    mpi_size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1)
    if mpi_size > 1:
        if built_with_mpi():
            return "mpi"
        warnings.warn(f"pacer: started as one of {mpi_size} MPI ranks, but pacer was built without MPI and "
                      "torch.distributed is not initialised: this process saves as a world of one rank")
    return None


# ---- the front door -----------------------------------------------------------


def _optimizers(before):
    if before is None:
        return []
    items = list(before) if isinstance(before, (list, tuple)) else [before]
    for o in items:
        if not callable(getattr(o, "step", None)):
            raise Error(f"save(before=...) takes optimizers (objects with step()), not {type(o).__name__}")
    return items


def _order_steps_after(handle, optimizers, flat):
    """Each optimizer's next step() waits on the GPU for the deferred copies; `flat` keeps their sources alive."""
    torch = _torch()
    hooks = []
    state = {"flat": flat}

    def fence(optimizer, args, kwargs):
        if state["flat"] is not None:
            for d in state["flat"].cuda_devices:
                handle.order_before(torch.cuda.current_stream(d).cuda_stream)
        # The stream's later work (which may reuse a freed temporary's memory) now follows the copies.
        state["flat"] = None
        for h in hooks:
            h.remove()
        hooks.clear()
        return None

    for o in optimizers:
        hooks.append(o.register_step_pre_hook(fence))


class Checkpointer:
    """Asynchronous, checksummed, crash-consistent checkpoints of training state under `root`.

    `fast_tier` (node-local disk or /dev/shm) takes each save first and is
    copied to `root` in the background. Retention keeps the newest
    `keep_last` checkpoints and every step that is a multiple of `keep_every`.
    Saving copies the data into a bounded staging area (`staging_bytes`) and
    returns; tensors and arrays may be modified right after `save` returns.
    A state larger than the staging area makes save() wait for the disk,
    unless `overflow_bytes` allows that much ordinary memory beyond it (kept
    for later saves, handed back to the kernel lazily between them; see
    docs/checkpoint.md).

    Several ranks: with torch.distributed initialised (world size > 1) every
    rank of `group` (default: the whole world) constructs the Checkpointer and
    calls save()/wait() for the same steps; the step commits only when every
    rank's part is durable. Collectives run on a gloo side group and give up
    after `timeout` seconds. Under mpirun without torch.distributed, pacer's
    MPI world is used when pacer was built with MPI.
    """

    def __init__(self, root, fast_tier=None, keep_last=3, keep_every=0, staging_bytes=1 << 30, chunk_bytes=64 << 20,
                 group=None, timeout=300.0, overflow_bytes=0):
        self._comm = _communicator(group, timeout)
        # What the last load() read: {"step", "dir", "shared" (read in parts between the ranks), "bytes_read"
        # (from storage by this rank), "bytes_alone" (of those, not shared), "bytes_received" (from other ranks)}.
        self.last_load = None
        self._impl = _Checkpointer(str(root), None if fast_tier is None else str(fast_tier), keep_last, keep_every,
                                   staging_bytes, chunk_bytes, self._comm, overflow_bytes)

    @property
    def rank(self):
        return self._impl.rank

    @property
    def world_size(self):
        return self._impl.size

    def save(self, step, state, meta=None, before=None):
        """Stages `state` (a dict; see the module doc) and returns a SaveHandle; wait() for it to be durable.

        Without `before`, save() returns once every byte is in host memory, so the caller may change
        its tensors at once. With `before=optimizer` (or a list of optimizers), CUDA tensors' copies
        are only queued when save() returns: they run while the next forward and backward compute,
        and each optimizer's next step() is ordered after them on the GPU, without blocking the host.
        Nothing else may write those tensors before that step (or handle.wait_copied()). Needs
        torch >= 2.0 (Optimizer.register_step_pre_hook); on older torch it saves as without `before`.
        """
        if not isinstance(state, dict):
            raise Error(f"state must be a dict, not {type(state).__name__}")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise Error("checkpoint meta must be a JSON object (a dict)")
        if META_KEY in meta:
            raise Error(f"meta key '{META_KEY}' is reserved for pacer's record of the state")
        # The data-set version the run trains on (pacer data, docs/curate.md), unless the caller named one.
        if os.environ.get("PACER_DATA_VERSION") and "data_version" not in meta:
            meta = {**meta, "data_version": os.environ["PACER_DATA_VERSION"]}
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise Error(f"meta cannot be stored as JSON: {e}") from None
        flat = _Flattener()
        flat.rank = self.rank
        try:
            tree = flat.node(state, ())
        except RecursionError:
            raise Error("state nests too deeply to be saved") from None
        meta_json = json.dumps({**meta, META_KEY: {"schema": SCHEMA, "tree": tree}}, allow_nan=False)
        stream = 0
        if flat.cuda_devices:
            torch = _torch()
            first = flat.cuda_devices[0]
            for d in flat.cuda_devices[1:]:  # one producer stream per save: the others finish first
                torch.cuda.current_stream(d).synchronize()
            stream = torch.cuda.current_stream(first).cuda_stream
        optimizers = _optimizers(before)
        defer = bool(optimizers and flat.cuda_devices) and all(hasattr(o, "register_step_pre_hook") for o in optimizers)
        handle = self._impl.save(step, flat.blobs, meta_json, stream, defer)
        if defer:
            _order_steps_after(handle, optimizers, flat)
        return handle

    def latest(self):
        """The newest step whose every byte checks (it reads the whole step), or None."""
        return self._impl.latest()

    def steps(self):
        """Committed steps whose manifests and file sizes check, newest first, without reading their data.

        `if ck.steps(): ck.load(...)` resumes reading each byte once, where
        `latest()` would first read the newest step to check it.
        """
        return sorted({r.step for r in self._impl.candidates(None)}, reverse=True)

    def open(self, step=None):
        """A Reader for `step` (default: the latest valid one)."""
        return self._impl.open_reader(step)

    def load(self, step=None, into=None, map_location="cpu", collective=True):
        """Loaded(step, state, meta) of `step` or of the latest valid checkpoint.

        Without `into`: the saved structure, tensors on `map_location` (default
        CPU), numpy arrays as numpy arrays. With `into` (a dict shaped like the
        saved state, e.g. {"model": model.state_dict(), ...}): tensors and
        arrays are filled in place (they keep their device and dtype; shapes and
        dtypes must match), other values are replaced in their containers, and
        `into` is returned as the state. A checkpoint that does not fit raises
        pacer.Error naming the key path.

        Every byte is checked against its checksum as it is read, once; a copy
        that fails is skipped with a warning and the next candidate (the other
        tier's copy, then the next older step) is read instead.

        Several ranks (torch.distributed): like save(), load() is called by
        every rank of the group, and every rank resumes from the same step:
        the newest one that every rank can read, whatever copies each lists;
        when one rank cannot load any (or raises), every rank raises. When
        the job's group is NCCL, the CUDA tensors that every rank loads alike
        (DDP's replicated tensors) are read once, each piece by one rank, and
        broadcast to the others, so N ranks read the bytes once, not N times;
        host memory is read by each rank itself. `collective=False` loads on
        this rank alone (a rank that loads when the others do not).
        """
        if into is not None and not isinstance(into, dict):
            raise Error(f"load(into=...) takes a dict, not {type(into).__name__}")
        shared = None
        if collective and isinstance(self._comm, TorchCommunicator) and self._comm.size() > 1:
            shared = _SharedLoad(self._comm)
        try:
            return self._load(step, into, map_location, shared)
        finally:
            if shared is not None:
                shared.stop()  # an error here: the others are told, not kept waiting

    def _load(self, step, into, map_location, shared):
        problems = []
        candidates = list(self._impl.candidates(step))
        i = 0
        while i < len(candidates):
            reader = candidates[i]
            planned = False  # until then a failure is this rank's alone: the others hear of it
            try:
                try:
                    meta = json.loads(reader.meta_json)
                except (ValueError, RecursionError) as e:
                    raise _Bad(f"meta is not readable: {e}") from None
                stored = meta.pop(META_KEY, None) if isinstance(meta, dict) else None
                if stored is None:
                    tree = _flat_tree(reader)
                elif isinstance(stored, dict) and stored.get("schema") == SCHEMA:
                    tree = stored.get("tree")
                else:
                    schema = stored.get("schema") if isinstance(stored, dict) else stored
                    raise _Bad(f"the stored state has schema {schema!r}, not {SCHEMA} (written by a newer pacer?)")
                if not (isinstance(tree, dict) and tree.get("t") in ("dict", "odict")):
                    raise _Bad("the stored state is not a dict")
                plan = _Plan(reader, map_location, self.rank)
                try:
                    if into is None:
                        state = plan.build(tree, ())
                    else:
                        state = plan.restore(tree, into, ())
                except RecursionError:
                    raise _Bad("the stored state nests too deeply") from None
                planned = True
                plan.run(shared)
                self.last_load = {"step": reader.step, "dir": reader.dir, "shared": bool(shared and shared.used),
                                  "bytes_read": plan.bytes_read, "bytes_alone": plan.bytes_alone,
                                  "bytes_received": plan.bytes_received}
                return Loaded(reader.step, _resolve(state), meta)
            except _Mismatch as e:
                raise _Mismatch(f"step {reader.step}: {e}") from None  # no fallback: load()'s stop() tells the others
            except _Collective as e:
                raise Error(f"step {reader.step}: {e}") from None
            except Error as e:
                if shared is not None and not shared.active:
                    # The ranks agreed on this step and the others have it: none may fall back alone.
                    raise Error(f"step {reader.step}: {e}") from None
                if shared is not None and not planned:
                    shared.plan_failed(reader.step)
                if shared is not None and shared.stay:
                    continue  # this rank's copy is fine: tried again with the others
                warnings.warn(f"pacer: skipping step {reader.step} in {reader.dir}: {e}")
                problems.append(str(e))
                i = i + 1 if shared is None else shared.skip_to(candidates, i)
        where = f"step {step}" if step is not None else "any step"
        raise Error(f"no valid checkpoint for {where}" + (": " + "; ".join(problems) if problems else ""))

    def flush(self):
        """Wait for every save and tier copy; raise the first error."""
        self._impl.flush()

    def reserve(self, device=None):
        """Makes the staging pool (`staging_bytes`) ready in the background, so the first save() does not pay for it.

        The memory is allocated, faulted in and, for copies from CUDA `device`
        (an index, a torch.device or "cuda:N"; default: the current CUDA device
        when CUDA is initialised, else none), page-locked. Returns at once; a
        save that starts meanwhile uses what is ready. Call it once the model
        is on its device, well before the first save; a second call does nothing.
        """
        if device is None:
            torch = sys.modules.get("torch")
            cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
            index = torch.cuda.current_device() if cuda else -1
        elif isinstance(device, int):
            index = device
        else:
            d = _torch().device(device)
            index = -1 if d.type != "cuda" else (d.index if d.index is not None else _torch().cuda.current_device())
        self._impl.reserve(int(index))

    def stats(self):
        """{saves, bytes_staged, staging_bytes, pinned_bytes, overflow_bytes, pool_waits, blocked_s}: what saving has cost.

        blocked_s is the time save() held the caller inside the library
        (the Python flattening of the state not included); pinned_bytes the
        staging memory page-locked for copies from the GPU; overflow_bytes the
        ordinary memory taken beyond staging_bytes (of staging_bytes);
        pool_waits how often save() found the staging full and waited for
        the writer (the disk).
        """
        return self._impl.stats()


# ---- retention and export by hand ---------------------------------------------


def prune(root, keep_last=3, keep_every=0, remove_damaged=False, dry_run=False):
    """Retention by hand, as `pacer ckpt prune`: only valid steps count, and the newest valid step always stays.

    The newest keep_last valid steps and every multiple of keep_every (when > 0) stay. Damaged steps are reported
    and left unless remove_damaged; a step that a reader holds is skipped (busy). With dry_run nothing is removed.
    Returns a dict: newest_valid (a step or None), removed and kept (steps, newest first; with dry_run: would be
    removed), damaged ((path, problem) pairs), removed_damaged (paths), busy (steps) and removed_partial ((path, why)
    pairs: stale .partial-* directories of saves that are gone, see docs/checkpoint.md).
    """
    if keep_last < 1:
        raise Error("keep_last must be at least 1")
    if keep_every < 0:
        raise Error("keep_every must be 0 or more")
    return _prune(os.fspath(root), int(keep_last), int(keep_every), bool(remove_damaged), bool(dry_run))


def export_safetensors(root, out_dir, step=None, prefix="model", max_shard_bytes=5_000_000_000):
    """Writes a step's model tensors in the safetensors format, as `pacer ckpt export --safetensors`.

    The tensors saved under `prefix` (the "model" entry of the state by default; "" exports every tensor) go to
    out_dir/model.safetensors, or, above max_shard_bytes, to numbered files and model.safetensors.index.json, each
    read back and compared before the next. step=None: the newest step that reads back whole. Returns a dict: step,
    files, tensors, bytes and skipped (newer damaged steps passed over, each with why).
    """
    return _export_safetensors(os.fspath(root), step, os.fspath(out_dir), prefix, int(max_shard_bytes))


# ---- random number generators -------------------------------------------------


def rng_state():
    """The states of Python's random, numpy's global RNG, torch's CPU RNG and every CUDA device's RNG."""
    s = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = _torch()
    if torch is not None:
        s["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s):
    """Restores what rng_state() returned (after a load: tensors may be on any device)."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch = _torch()
    if "torch" in s:
        torch = torch or __import__("torch")
        torch.set_rng_state(s["torch"].cpu())
    if "cuda" in s and torch is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in s["cuda"]])

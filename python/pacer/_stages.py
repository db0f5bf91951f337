"""What pacer.data.Loader does to a batch of tar samples after reading it: decode, to_tuple, map, collate.

Fields are matched by the part of their extension after its last dot, as
WebDataset does ("seg.png" is decoded as a png). Decoders get the field's
bytes (a bytes object or a read-only memoryview) and return the value.
"""
import io
import json

from ._pacer import Error

# WebDataset's names for each kind of field.
TEXT = ("txt", "text", "transcript")
INTEGER = ("cls", "cls2", "class", "count", "index", "inx", "id")
JSON = ("json", "jsn")
NUMPY = ("npy",)
TORCH = ("pt", "pth")
# What Pillow opens; decoded only when Pillow is installed (python3-pil).
IMAGES = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "pnm", "bmp", "gif", "tif", "tiff")
# decode= values that decode every known field, and what images become.
IMAGE_MODES = ("pil", "rgb8", "rgb", "l8", "torchrgb8", "torchrgb")


def suffix(ext):
    """The extension's last part: what picks its decoder."""
    return ext.rsplit(".", 1)[-1]


def decode_npy(data):
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_text(data):
    return str(data, "utf-8")


def decode_int(data):
    return int(bytes(data).strip())


def decode_json(data):
    return json.loads(bytes(data))


def decode_torch(data):
    import torch

    # weights_only: a shard is untrusted input, and a full unpickler runs whatever it is told to.
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except TypeError:  # a torch without weights_only
        raise Error("decoding .pt/.pth needs torch.load(weights_only=True) (torch >= 1.13)") from None


class ImageDecoder:
    """Images into `mode`: a PIL image, or a numpy array / torch tensor of the pixels (a class: it pickles)."""

    def __init__(self, mode):
        self.mode = mode

    def __call__(self, data):
        mode = self.mode
        try:
            import PIL.Image
        except ImportError:
            raise Error("decoding images needs Pillow (Debian: python3-pil)") from None
        with PIL.Image.open(io.BytesIO(data)) as im:
            im.load()
            if mode == "pil":
                return im.copy()
            import numpy as np

            pixels = np.asarray(im.convert("L" if mode == "l8" else "RGB"))
        if mode in ("rgb8", "l8"):
            return pixels
        if mode == "rgb":
            return pixels.astype("float32") / 255.0
        import torch

        t = torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # HWC -> CHW, as torchvision has it
        return t if mode == "torchrgb8" else t.float() / 255.0


def decoders_for(decode, extra=None):
    """{suffix: decoder} for a Loader's decode= and decoders= arguments."""
    table = {}
    if decode is True:  # the original behaviour: arrays only
        table.update({e: decode_npy for e in NUMPY})
    elif isinstance(decode, str):
        if decode not in IMAGE_MODES:
            raise ValueError(f"decode={decode!r}: one of True, False or an image mode {IMAGE_MODES}")
        for names, fn in ((TEXT, decode_text), (INTEGER, decode_int), (JSON, decode_json), (NUMPY, decode_npy),
                          (TORCH, decode_torch), (IMAGES, ImageDecoder(decode))):
            table.update({e: fn for e in names})
    elif decode not in (False, None):
        raise ValueError(f"decode={decode!r}: one of True, False or an image mode {IMAGE_MODES}")
    for ext, fn in (extra or {}).items():
        if not callable(fn):
            raise TypeError(f"decoders[{ext!r}] is not callable")
        table[suffix(ext)] = fn
    return table


def decode_sample(sample, decode="rgb8", decoders=None):
    """One sample dict ({"__key__", ext: bytes}) with its fields decoded as a Loader with decode= would."""
    table = decoders_for(decode, decoders)
    out = {}
    for ext, value in sample.items():
        fn = table.get(suffix(ext)) if ext != "__key__" and value is not None else None
        out[ext] = fn(value) if fn else value
    return out


class Stages:
    """The per-batch work: picklable, so worker processes can run it."""

    def __init__(self, decode=True, decoders=None, to_tuple=None, map=None, collate=None):
        self.table = decoders_for(decode, decoders)
        if to_tuple is not None:
            if isinstance(to_tuple, str):
                to_tuple = (to_tuple,)
            to_tuple = tuple(to_tuple)
            if not to_tuple or not all(isinstance(t, str) and t for t in to_tuple):
                raise ValueError("to_tuple: field names such as ('jpg;png', 'cls')")
        self.to_tuple = to_tuple
        if map is not None and not callable(map):
            raise TypeError("map= must be callable")
        if collate is not None and not callable(collate):
            raise TypeError("collate= must be callable")
        self.map = map
        self.collate = collate

    def __call__(self, batch):
        keys = batch["__key__"]
        for ext, values in batch.items():
            if ext == "__key__":
                continue
            fn = self.table.get(suffix(ext))
            if fn is not None:
                out = []
                for i, v in enumerate(values):
                    try:
                        out.append(None if v is None else fn(v))
                    except Error:
                        raise
                    except Exception as e:
                        raise Error(f"sample '{keys[i]}': field '{ext}' does not decode: {type(e).__name__}: {e}") from e
                batch[ext] = out
        if self.to_tuple is None and self.map is None and self.collate is None:
            return batch
        if self.to_tuple is not None:
            columns = [self._column(batch, keys, spec) for spec in self.to_tuple]
            if self.map is None and self.collate is None:
                return tuple(columns)
            samples = list(zip(*columns)) if keys else []
        else:
            fields = [e for e in batch if e != "__key__"]
            samples = [{"__key__": k, **{e: batch[e][i] for e in fields if batch[e][i] is not None}} for i, k in enumerate(keys)]
        if self.map is not None:
            samples = [self.map(s) for s in samples]
        if self.collate is not None:
            return self.collate(samples)
        return columns_of(samples)

    @staticmethod
    def _column(batch, keys, spec):
        names = spec.split(";")
        cols = [batch.get(n) for n in names]
        out = []
        for i, k in enumerate(keys):
            for col in cols:
                if col is not None and col[i] is not None:
                    out.append(col[i])
                    break
            else:
                have = sorted(e for e in batch if e != "__key__" and batch[e][i] is not None)
                raise Error(f"sample '{k}' has no field {' or '.join(repr(n) for n in names)} (it has {have})")
        return out


def columns_of(samples):
    """A list of samples as one batch: tuples as a tuple of lists, dicts as a dict of lists, else the list."""
    if samples and all(isinstance(s, tuple) for s in samples) and len({len(s) for s in samples}) == 1:
        return tuple(list(c) for c in zip(*samples))
    if samples and all(isinstance(s, dict) for s in samples):
        names = list(dict.fromkeys(k for s in samples for k in s))
        return {n: [s.get(n) for s in samples] for n in names}
    return list(samples)


# ---- worker processes (map_workers, and pacer.data.tokenize's callables) -----

_worker_function = None


def _init_worker(function):
    """A process pool's initializer: the callable this worker runs (stages, a batch encoder)."""
    global _worker_function
    _worker_function = function


def _run_in_worker(arg):
    return _worker_function(arg)


def portable(batch):
    """The batch with memoryviews copied to bytes, to be pickled to a worker process."""
    return {ext: (values if ext == "__key__" else [None if v is None else bytes(v) for v in values]) for ext, values in batch.items()}

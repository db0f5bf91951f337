"""pacer.data: shards and a deterministic, resumable loader.

Datasets are WebDataset tar shards (written by ``pacer shard pack`` or any tar
writer) with a ``.pidx`` index beside each shard, built on first open when
missing::

    ds = pacer.data.open("shards/manifest.json")    # or "train-{000000..000099}.tar", a glob, a list of paths
    len(ds), ds.shards, ds.shard_samples
    ds[17]                                          # {"__key__": "dir/000017", "jpg": b"...", "json": b"..."}

    loader = pacer.data.Loader(ds, batch_size=32, seed=0, rank=rank, world_size=world)
    for epoch in range(3):
        for batch in loader:                        # {"__key__": [keys], "jpg": [bytes, ...], "npy": [ndarray, ...]}
            ...
    state = loader.state_dict()                     # store it with the checkpoint
    loader.load_state_dict(state)                   # continues exactly, also with another world size

Every ``for`` loop over a loader reads one epoch; once an epoch has been read
to its end, the next loop starts the following epoch (as a DataLoader whose
sampler gets ``set_epoch``). A loop left early continues where it stopped.
The order depends only on (seed, epoch): a seeded permutation of all samples,
split between ranks by global batch, so the ranks together read every sample
exactly once per epoch.
"""
import array
import io
import json
import multiprocessing
import operator
import os

from . import _pacer
from ._pacer import Error, _Dataset, _Loader, _open_dataset

__all__ = ["Dataset", "Error", "Loader", "open", "tokenize"]


def _is_npy(ext):
    return ext == "npy" or ext.endswith(".npy")


def _decode_npy(data):
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


class Dataset:
    """Opened shards; samples are numbered 0..len-1 across shards in shard order."""

    def __init__(self, impl):
        """Not called directly: pacer.data.open(spec) opens a dataset."""
        if not isinstance(impl, _Dataset):
            raise TypeError("use pacer.data.open(spec) to open a dataset")
        self._impl = impl

    def __len__(self):
        """Samples over all shards."""
        return len(self._impl)

    @property
    def shards(self):
        """The shard paths, in order."""
        return list(self._impl.shards)

    @property
    def shard_samples(self):
        """The number of samples in each shard."""
        return list(self._impl.shard_samples)

    samples_per_shard = shard_samples

    def __getitem__(self, i):
        """{"__key__": key, ext: bytes, ...} of sample i (negative i counts from the end)."""
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} of a {n}-sample dataset")
        return self._impl.read(i)

    def __iter__(self):
        """Every sample in order, as ds[i] gives it."""
        for i in range(len(self)):
            yield self[i]

    def __repr__(self):
        return f"<pacer.data.Dataset: {len(self)} samples in {len(self._impl.shards)} shard(s)>"


class TokenDataset:
    """A Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx).

    ds[i] is sequence i as a read-only numpy array (read from PREFIX.bin with
    pread: a .bin truncated while open raises pacer.Error naming it instead of
    crashing the process); ds.document(d) gives the range of sequences of
    document d.
    """

    def __init__(self, prefix):
        """Opens PREFIX.bin and PREFIX.idx; a truncated or inconsistent pair raises pacer.Error naming the file."""
        self._impl = _pacer._TokenDataset(os.fsdecode(prefix))

    def __len__(self):
        """Sequences in the dataset."""
        return len(self._impl)

    @property
    def dtype(self):
        """The token dtype, a numpy name ("uint16", "int32", ...)."""
        return self._impl.dtype

    @property
    def documents(self):
        """Documents in the dataset."""
        return self._impl.documents

    @property
    def tokens(self):
        """Tokens over all sequences."""
        return self._impl.tokens

    def document(self, d):
        """(first, end): document d is sequences first..end-1."""
        return self._impl.document(d)

    def __getitem__(self, i):
        """Sequence i as a read-only numpy array viewing the mapping (negative i counts from the end)."""
        import numpy as np

        if i < 0:
            i += len(self)
        return np.frombuffer(self._impl.sequence_bytes(i), dtype=np.dtype(self.dtype))

    def __repr__(self):
        return f"pacer.data.TokenDataset({len(self)} sequences, {self.documents} documents, {self.tokens} {self.dtype} tokens)"


def write_tokens(prefix, documents, dtype="int32"):
    """Writes documents (lists of token ids) as a Megatron-Core indexed dataset."""
    _pacer._write_token_dataset(os.fsdecode(prefix), dtype, [list(map(int, d)) for d in documents])


def open(spec):  # noqa: A001 - the module's front door, as in tarfile.open
    """Opens shards: a path, "train-{000000..000099}.tar", a glob, a manifest.json, or a list of paths;
    or a Megatron-Core dataset prefix (PREFIX.idx and PREFIX.bin exist)."""
    if isinstance(spec, (str, bytes, os.PathLike)):
        path = os.fsdecode(spec)
        if os.path.exists(path + ".idx") and os.path.exists(path + ".bin"):
            return TokenDataset(path)
        return Dataset(_open_dataset(path))
    return Dataset(_open_dataset([os.fsdecode(s) for s in spec]))


class Loader:
    """Batches of one rank, read ahead by `threads` reader threads, `prefetch` batches deep.

    Over tar shards each batch is a dict {"__key__": [keys], ext: [values]}.
    Values are read-only memoryviews into the batch's buffer (no copy; bytes(v)
    or v.tobytes() copies, np.frombuffer(v) and torch.frombuffer(v) view it),
    or bytes with copy=True; fields whose extension is "npy" are decoded to
    numpy arrays (decode=True). A sample that lacks a field has None there.
    The buffer is reused once no value or array of the batch is referenced.

    Over a Megatron dataset (TokenDataset) each batch is a dict of numpy arrays:
    "tokens" int64 [rows, cols], "position_ids" int32 [rows, cols] (restarting
    at 0 in every segment), "cu_seqlens" int32 (segment boundaries over the
    flattened rows; a row's padded tail is a segment of its own), "documents"
    int64 (each segment's document, -1 for padding) and "lengths" (real tokens
    per row). With pack=True documents are packed into seq_len-token rows
    (best-fit decreasing within pack_window documents); otherwise each row is
    one document, cut to seq_len when it is set, and bucket_window=K sorts
    documents by length within windows of K global batches to cut padding.
    With pin_memory the buffers are page-locked (when CUDA is present), and
    device="cuda" returns torch tensors copied there asynchronously.

    len(loader) is the number of batches per epoch. With skip_bad, samples
    that cannot be read are skipped and counted in stats()["skipped"].
    """

    def __init__(self, dataset, batch_size=32, seed=0, rank=0, world_size=1, shuffle=True, drop_last=False, threads=2,
                 prefetch=4, skip_bad=False, decode=True, max_bytes=512 << 20, copy=False, seq_len=None, pack=False,
                 pack_window=1000, bucket_window=0, pad_id=0, pin_memory=False, device=None):
        """Opens a loader over `dataset`; reading starts at once, in the background.

        Args:
            dataset: a Dataset or TokenDataset, or anything pacer.data.open takes.
            batch_size: samples (token datasets: rows) per batch of this rank.
            seed: seeds the order; the same (seed, epoch) gives the same order.
            rank: this rank, 0 <= rank < world_size.
            world_size: the ranks sharing each epoch; each reads its own part of every global batch.
            shuffle: a seeded permutation per epoch (False: in order).
            drop_last: drop the last, partial global batch (False: split it as evenly as possible).
            threads: reader threads.
            prefetch: batches read ahead of the consumer.
            skip_bad: skip samples that cannot be read (counted in stats()["skipped"]) instead of raising.
            decode: decode fields with extension "npy" into numpy arrays (tar shards).
            max_bytes: bound on the bytes held in prefetched batches.
            copy: field values as bytes instead of memoryviews into the batch buffer (tar shards).
            seq_len: token datasets: the row length (packed rows are exactly this long; unpacked rows are cut to it).
            pack: token datasets: pack documents into seq_len-token rows.
            pack_window: token datasets: documents per packing window (best-fit decreasing within it).
            bucket_window: token datasets, unpacked: sort documents by length within windows of this many
                global batches (0: off).
            pad_id: token datasets: the token id of padding.
            pin_memory: page-lock the batch buffers (when CUDA is present) for asynchronous device copies.
            device: token datasets: return torch tensors on this device (e.g. "cuda"), copied from pinned buffers.

        Raises pacer.Error for a bad option, a rank outside the world or a
        dataset with fewer items than ranks, naming what is wrong.
        """
        if not isinstance(dataset, (Dataset, TokenDataset)):
            dataset = open(dataset)
        self.dataset = dataset
        self.decode = decode
        options = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle,
                       drop_last=drop_last, threads=threads, prefetch=prefetch, max_bytes=max_bytes, skip_bad=skip_bad,
                       pin_memory=bool(pin_memory or device is not None))
        if isinstance(dataset, TokenDataset):
            options.update(seq_len=seq_len or 0, pack=pack, pack_window=pack_window, bucket_window=bucket_window,
                           pad_id=pad_id)
            self._impl = _Loader(dataset._impl, options)
        else:
            if pack or seq_len or bucket_window:
                raise ValueError("seq_len, pack and bucket_window are for token datasets (a Megatron PREFIX)")
            if device is not None:
                raise ValueError("device= moves token batches; samples from tar shards are bytes")
            self._impl = _Loader(dataset._impl, options, bool(copy))
        self.device = device
        self._in_flight = []  # (event, host batch) until the device copy is done
        self._finished = False  # the current epoch was read to its end

    def __len__(self):
        """Batches of this rank per epoch (token datasets with pack=True: of the current epoch)."""
        return self._impl.batches_per_epoch()

    def __iter__(self):
        """The batches of one epoch; a loop read to the end makes the next loop read the next epoch."""
        return self._epoch()

    def _start_next_epoch(self):
        self._impl.set_epoch(self.epoch + 1)
        self._finished = False

    def _epoch(self):
        advanced = self._finished
        if self._finished:
            self._start_next_epoch()
        yielded = False
        while True:
            item = self._impl.next()  # releases the GIL while it waits
            if item is None:
                # A state saved at the very end of an epoch: nothing is left of
                # it, so this loop reads the next one.
                if not yielded and not advanced and len(self) > 0:
                    self._start_next_epoch()
                    advanced = True
                    continue
                self._finished = True
                return
            yielded = True
            batch, pinned = item
            if self.device is not None:
                yield self._to_device(batch, pinned)
            else:
                yield self._decode(batch)

    def _decode(self, batch):
        if self.decode:
            for ext, values in batch.items():
                if ext != "__key__" and _is_npy(ext):
                    batch[ext] = [None if v is None else _decode_npy(v) for v in values]
        return batch

    def _to_device(self, batch, pinned):
        import torch

        device = torch.device(self.device)
        out = {k: torch.from_numpy(v).to(device, non_blocking=pinned) for k, v in batch.items()}
        if pinned and device.type == "cuda":
            # The host buffer goes back to the pool when `batch` is dropped: keep
            # it until the copy has run, so a reader cannot overwrite it mid-copy.
            event = torch.cuda.Event()
            event.record()
            self._in_flight.append((event, batch))
            while self._in_flight and (len(self._in_flight) > 8 or self._in_flight[0][0].query()):
                self._in_flight.pop(0)[0].synchronize()
        return out

    @property
    def epoch(self):
        """The epoch the next batch comes from."""
        return self.state_dict()["epoch"]

    def set_epoch(self, epoch):
        """Start epoch `epoch` from its beginning."""
        self._impl.set_epoch(int(epoch))
        self._finished = False

    def state_dict(self):
        """{"schema", "seed", "epoch", "position", "global_batch", "samples", "order"}: where the next batch starts."""
        return json.loads(self._impl.state())

    def load_state_dict(self, state):
        """Continues from a state_dict(): exactly where it was taken, also with another world size.

        A state for another dataset size or order (seed, shuffle, seq_len, packing, ...) raises pacer.Error.
        """
        self._impl.load_state(json.dumps(state))
        self._finished = False

    def stats(self):
        """wait_s, last_wait_s, batches, samples, bytes, skipped, queue_depth, elapsed_s; token loaders also
        count tokens, padding, truncated and padding_fraction (pad tokens / all tokens delivered)."""
        return self._impl.stats()

    def __repr__(self):
        return f"<pacer.data.Loader: {len(self)} batches per epoch over {len(self.dataset)} items>"


# ---------------------------------------------------------------------------
# Tokenizing: text and JSON lines to a Megatron-Core token dataset.

_worker_tokenizer = None


def _set_worker_tokenizer(tokenizer):
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_batch(docs):
    # In a worker process: the ids go back as two byte strings, which pickle as one copy each.
    ids, lengths = array.array("q"), array.array("Q")
    for d in docs:
        e = _worker_tokenizer(d)
        ids.extend(e)
        lengths.append(len(e))
    return ids.tobytes(), lengths.tobytes()


def _attribute(tokenizer, names):
    """The first int that tokenizer (or the object of a bound method) has under one of names, calling methods."""
    for obj in (tokenizer, getattr(tokenizer, "__self__", None)):
        if obj is None:
            continue
        for n in names:
            v = getattr(obj, n, None)
            if callable(v):
                try:
                    v = v()
                except TypeError:
                    continue
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _callable_name(tokenizer):
    owner = getattr(tokenizer, "__self__", None)
    if owner is not None and not isinstance(owner, type(os)):
        t = type(owner)
        return f"{t.__module__}.{t.__qualname__}.{getattr(tokenizer, '__name__', '?')}"
    name = getattr(tokenizer, "__qualname__", None) or type(tokenizer).__qualname__
    return f"{getattr(tokenizer, '__module__', None) or type(tokenizer).__module__}.{name}"


def tokenize(inputs, prefix, tokenizer, field="text", document="line", eod="eos", bad_utf8="replace", threads=None,
             vocab_size=None, chunk_bytes=256 << 10):
    """Tokenizes text or JSON lines into PREFIX.bin/.idx (Megatron-Core) and PREFIX.manifest.json.

    inputs: a path or a list of paths; NAME.jsonl/NAME.json are JSON lines (the string `field` of each line is a
    document), other files text (a document per non-empty line, or per file with document="file").
    tokenizer: a SentencePiece model file (encoded in C++ on `threads` threads, default every CPU), or a callable
    str -> list of ids (a Hugging Face ``tokenizers`` or ``tiktoken`` encoder) run in `threads` worker processes
    (forked, so a lambda works), chunks of documents each, results written in input order. For a callable,
    vocab_size and the eos id are taken from the callable or the object of a bound method (n_vocab,
    get_vocab_size, vocab_size; eot_token, eos_token_id, eos_id) unless given; a ``model_file`` attribute names
    the file whose checksum the manifest records. eod: "eos" (the tokenizer's), an id, or None for no
    end-of-document token. bad_utf8: "replace", "skip" or "fail". chunk_bytes: text per chunk (whole lines)
    handed to a thread or worker process. Returns the manifest's fields (a dict) plus
    "manifest", "threads" and "seconds"; errors raise pacer.Error naming file:line."""
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    if document not in ("line", "file"):
        raise ValueError(f"document={document!r}: expected 'line' or 'file'")
    threads = operator.index(threads) if threads else len(os.sched_getaffinity(0))
    opts = {"field": field, "document_per_file": document == "file", "threads": threads, "chunk_bytes": operator.index(chunk_bytes),
            "append_eod": eod is not None,
            "eod_id": None if eod is None or eod == "eos" else operator.index(eod), "bad_utf8": bad_utf8,
            "model": None, "vocab": None}
    args = ([os.fsdecode(p) for p in inputs], os.fsdecode(prefix))
    if isinstance(tokenizer, (str, bytes, os.PathLike)):
        opts["model"] = os.fsdecode(tokenizer)
        return json.loads(_pacer._tokenize(*args, opts))
    if not callable(tokenizer):
        raise TypeError(f"tokenizer: a SentencePiece model path or a callable str -> list of ids, not {type(tokenizer).__name__}")
    if vocab_size is None:
        vocab_size = _attribute(tokenizer, ("n_vocab", "get_vocab_size", "vocab_size"))
        if vocab_size is None:
            raise ValueError("tokenizer: its vocabulary size is not known; give vocab_size=")
    eos = _attribute(tokenizer, ("eot_token", "eos_token_id", "eos_id"))
    if eod == "eos" and (eos is None or eos < 0):
        raise ValueError("tokenizer: it has no end-of-document (eos) id; give eod=ID, or eod=None for none")
    model_file = getattr(tokenizer, "model_file", None) or getattr(getattr(tokenizer, "__self__", None), "model_file", None)
    opts.update(vocab_size=int(vocab_size), eos_id=eos if eos is not None and eos >= 0 else None, name=_callable_name(tokenizer),
                model_file=os.fsdecode(model_file) if model_file else "")
    ctx = multiprocessing.get_context("fork")  # fork: the tokenizer reaches the workers without pickling
    with ctx.Pool(threads, initializer=_set_worker_tokenizer, initargs=(tokenizer,)) as pool:
        opts["encode_batch"] = lambda docs: pool.apply(_encode_batch, (docs,))
        return json.loads(_pacer._tokenize(*args, opts))

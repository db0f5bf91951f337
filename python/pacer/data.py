"""pacer.data: shards and a deterministic, resumable loader.

Datasets are WebDataset tar shards (written by ``pacer shard pack`` or any tar
writer) with a ``.pidx`` index beside each shard, built on first open when
missing (a first open of 16 or more new shards of one directory writes their
indexes into one file there, ``.pacer-index``; docs/data.md)::

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
import builtins
import collections
import json
import multiprocessing
import operator
import os

from . import _dist, _pacer, _stages
from ._pacer import Error, _Dataset, _Loader, _open_dataset
from ._stages import decode_sample

__all__ = ["Blend", "Dataset", "Error", "Loader", "TokenDataset", "blend", "decode_sample", "open", "tokenize", "write_chat",
           "write_sft", "write_tokens"]


class Dataset:
    """Opened shards; samples are numbered 0..len-1 across shards in shard order."""

    def __init__(self, impl):
        """Not called directly: pacer.data.open(spec) opens a dataset."""
        if not isinstance(impl, _Dataset):
            raise TypeError("use pacer.data.open(spec) to open a dataset")
        self._impl = impl
        # Relative shard paths are relative to this directory, also for a copy
        # unpickled after a chdir (or in a spawned worker).
        self._cwd = os.getcwd()

    def __reduce__(self):
        """Pickled as its shard paths: an unpickled Dataset opens them again (their indexes make that cheap)."""
        return (_reopen_shards, ([os.path.join(self._cwd, p) for p in self._impl.shards],))

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


def _reopen_shards(paths):
    return Dataset(_open_dataset(list(paths)))


class TokenDataset:
    """A Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx).

    ds[i] is sequence i as a read-only numpy array (read from PREFIX.bin with
    pread: a .bin truncated while open raises pacer.Error naming it instead of
    crashing the process); ds.document(d) gives the range of sequences of
    document d.
    """

    def __init__(self, prefix):
        """Opens PREFIX.bin and PREFIX.idx; a truncated or inconsistent pair raises pacer.Error naming the file."""
        prefix = os.fsdecode(prefix)
        self._impl = _pacer._TokenDataset(prefix)
        self._prefix = os.path.abspath(prefix)

    def __reduce__(self):
        """Pickled as its prefix: an unpickled TokenDataset opens PREFIX.bin/.idx again."""
        return (TokenDataset, (self._prefix,))

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

    @property
    def has_loss_mask(self):
        """An SFT dataset (write_sft): PREFIX.mask.bin/.idx holds its loss mask, and loader batches carry labels."""
        return self._impl.has_loss_mask

    def document(self, d):
        """(first, end): document d is sequences first..end-1 (negative d counts from the end)."""
        d = operator.index(d)
        n = self.documents
        if d < 0:
            d += n
        if not 0 <= d < n:
            raise IndexError(f"document {d} of a {n}-document dataset")
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


def _process_pool_type():
    import multiprocessing.pool

    return multiprocessing.pool.Pool


_PROCESS_POOL = _process_pool_type()


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

    rank and world_size default to this process's place in its job
    (torch.distributed when initialised, else RANK/WORLD_SIZE, Slurm, Open MPI
    or PMI variables, else 0 of 1). A Loader pickles: an unpickled copy opens
    the dataset again and continues from the state it had.

    Tar batches then go through the stages decode, to_tuple, map, collate
    (docs/data.md "Decoding and mapping"), inline, in `map_threads` Python
    threads, or in `map_workers` processes, always delivered in order.

    Over an SFT dataset (write_sft, write_chat) token batches also hold
    "labels" int64 and "loss_mask" uint8 [rows, cols]: the next token where it
    is trained and in the same segment, else -100. Over a blend
    (pacer.data.blend) batches say which dataset each sample or row came from:
    "__dataset__" (tar samples) or "datasets" (token rows), and the blend's
    seed orders it.
    """

    def __init__(self, dataset, batch_size=32, seed=0, rank=None, world_size=None, shuffle=True, drop_last=False, threads=2,
                 prefetch=4, skip_bad=False, decode=True, max_bytes=512 << 20, copy=False, seq_len=None, pack=False,
                 pack_window=1000, bucket_window=0, pad_id=0, pin_memory=False, device=None, decoders=None,
                 to_tuple=None, map=None, collate=None, map_threads=0, map_workers=0, map_context=None):
        """Opens a loader over `dataset`; reading starts at once, in the background.

        Args:
            dataset: a Dataset or TokenDataset, or anything pacer.data.open takes.
            batch_size: samples (token datasets: rows) per batch of this rank.
            seed: seeds the order; the same (seed, epoch) gives the same order.
            rank: this rank, 0 <= rank < world_size (None: from torch.distributed or the launcher's environment).
            world_size: the ranks sharing each epoch; each reads its own part of every global batch (None: as rank).
            shuffle: a seeded permutation per epoch (False: in order).
            drop_last: drop the last, partial global batch (False: split it as evenly as possible).
            threads: reader threads (0: none, each batch is read in the loop's own thread). A loop that
                would wait for them reads a batch itself meanwhile.
            prefetch: batches read ahead of the consumer.
            skip_bad: skip samples that cannot be read (counted in stats()["skipped"]) instead of raising.
            decode: tar shards: True decodes fields with extension "npy" into numpy arrays; an image mode
                ("pil", "rgb8", "rgb", "l8", "torchrgb8", "torchrgb") decodes every field WebDataset names
                (json, cls/index/id ints, txt text, npy, pt/pth, images through Pillow, as that mode); False none.
            decoders: tar shards: {extension: function(bytes) -> value}, added to (or replacing) decode's.
            to_tuple: tar shards: field names, e.g. ("jpg;png", "cls"): each batch becomes a tuple of lists, one per
                name ("a;b": the first of a, b the sample has); a sample with none of them raises pacer.Error.
            map: tar shards: a function applied to each sample (a dict, or the tuple to_tuple made); the batch
                is then the list of results as columns (tuples as a tuple of lists, dicts as a dict of lists).
            collate: tar shards: a function making the batch from the list of samples
                (e.g. torch.utils.data.default_collate); implies the per-sample path.
            map_threads: run the stages in this many Python threads, ahead of the consumer (0: in the consumer).
            map_workers: run the stages in this many worker processes instead (functions must pickle).
            map_context: the multiprocessing start method of the workers ("fork", "spawn", "forkserver").
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
        if not isinstance(dataset, (Dataset, TokenDataset, Blend)):
            dataset = open(dataset)
        rank, world_size = _dist.resolve_rank(rank, world_size, "pacer.data.Loader")
        # What a pickled copy is built from; rank and world size as resolved here.
        self._args = dict(dataset=dataset, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                          shuffle=shuffle, drop_last=drop_last, threads=threads, prefetch=prefetch, skip_bad=skip_bad,
                          decode=decode, max_bytes=max_bytes, copy=copy, seq_len=seq_len, pack=pack,
                          pack_window=pack_window, bucket_window=bucket_window, pad_id=pad_id, pin_memory=pin_memory,
                          device=device, decoders=decoders, to_tuple=to_tuple, map=map, collate=collate,
                          map_threads=map_threads, map_workers=map_workers, map_context=map_context)
        self.dataset = dataset
        self.decode = decode
        self._pool = None
        self._pending = collections.deque()  # (state before it, result) of batches read ahead of the consumer
        self._generation = 0  # bumped by set_epoch/load_state_dict: a running epoch loop stops
        options = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle,
                       drop_last=drop_last, threads=threads, prefetch=prefetch, max_bytes=max_bytes, skip_bad=skip_bad,
                       pin_memory=bool(pin_memory or device is not None))
        tokens = isinstance(dataset, TokenDataset) or (isinstance(dataset, Blend) and dataset.tokens)
        if tokens:
            options.update(seq_len=seq_len or 0, pack=pack, pack_window=pack_window, bucket_window=bucket_window,
                           pad_id=pad_id)
            if decoders or to_tuple or map or collate or map_threads or map_workers or isinstance(decode, str):
                raise ValueError("decoders, to_tuple, map, collate, map_threads, map_workers and image decoding "
                                 "are for tar shards; token batches are arrays already")
            self._stages = None
        else:
            if pack or seq_len or bucket_window:
                raise ValueError("seq_len, pack and bucket_window are for token datasets (a Megatron PREFIX)")
            if device is not None:
                raise ValueError("device= moves token batches; samples from tar shards are bytes")
            if map_threads and map_workers:
                raise ValueError("map_threads or map_workers, not both")
            if int(map_threads) < 0 or int(map_workers) < 0:
                raise ValueError("map_threads and map_workers count threads and processes: 0 or more")
            self._stages = _stages.Stages(decode, decoders, to_tuple, map, collate)
            # Workers start before the reader threads do: a fork then copies no thread of pacer's.
            if map_workers:
                import multiprocessing

                self._pool = multiprocessing.get_context(map_context).Pool(
                    int(map_workers), initializer=_stages._init_worker, initargs=(self._stages,))
            elif map_threads:
                import concurrent.futures

                self._pool = concurrent.futures.ThreadPoolExecutor(int(map_threads), thread_name_prefix="pacer-map")
            self._depth = 2 * int(map_workers or map_threads)
        try:
            if isinstance(dataset, Blend):
                if seed not in (0, dataset.seed):
                    raise ValueError(f"the blend's seed ({dataset.seed}) orders it; pass seed= to pacer.data.blend, "
                                     f"not {seed} here")
                options["seed"] = dataset.seed
                self._impl = _Loader([d._impl for d, _ in dataset.parts], [w for _, w in dataset.parts],
                                     dataset.samples_per_epoch or 0, options, bool(copy))
            elif tokens:
                self._impl = _Loader(dataset._impl, options)
            else:
                self._impl = _Loader(dataset._impl, options, bool(copy))
        except BaseException:
            self.close()
            raise
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

    def _raw_epoch(self):
        """(batch, pinned) as the readers deliver them, to the end of the epoch."""
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
            yield item

    def _epoch(self):
        if self._pool is None:
            for batch, pinned in self._raw_epoch():
                if self.device is not None:
                    yield self._to_device(batch, pinned)
                elif self._stages is not None:
                    yield self._stages(batch)
                else:
                    yield batch
            return
        yield from self._pipelined()

    def _submit(self, batch):
        if isinstance(self._pool, _PROCESS_POOL):
            return self._pool.apply_async(_stages._run_in_worker, (_stages.portable(batch),)).get
        return self._pool.submit(self._stages, batch).result

    def _pipelined(self):
        # Batches are handed to the pool ahead of the consumer and taken back
        # in order. The state before each one is kept, so state_dict() is that
        # of the next batch the consumer gets, however far the pool has read.
        generation = self._generation
        source = self._raw_epoch()
        pending = self._pending
        done = False
        try:
            while True:
                while not done and len(pending) < self._depth:
                    state = self._impl.state()
                    item = next(source, None)
                    if item is None:
                        done = True
                        break
                    pending.append((state, self._submit(item[0])))
                if not pending:
                    return
                result = pending[0][1]()
                pending.popleft()
                yield result
                if generation != self._generation:
                    return
        finally:
            # A loop left early: the batches read ahead are read again by the next loop.
            if pending and generation == self._generation:
                state = pending[0][0]
                pending.clear()
                self._impl.load_state(state)
                self._finished = False

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
        self._drop_pending()
        self._impl.set_epoch(int(epoch))
        self._finished = False

    def _drop_pending(self):
        self._generation += 1
        self._pending.clear()

    def state_dict(self):
        """{"schema", "seed", "epoch", "position", "global_batch", "samples", "order"}: where the next batch starts."""
        if self._pending:
            return json.loads(self._pending[0][0])
        return json.loads(self._impl.state())

    def load_state_dict(self, state):
        """Continues from a state_dict(): exactly where it was taken, also with another world size.

        A state for another dataset size or order (seed, shuffle, seq_len, packing, ...) raises pacer.Error.
        A blend's state loaded with other weights continues every dataset where it stopped, with the new weights.
        """
        self._drop_pending()
        self._impl.load_state(json.dumps(state))
        self._finished = False

    def __getstate__(self):
        return {"args": self._args, "state": self.state_dict()}

    def __setstate__(self, saved):
        args = dict(saved["args"])
        self.__init__(args.pop("dataset"), **args)
        self.load_state_dict(saved["state"])

    def close(self):
        """Stops the map workers or threads (the reader threads stop when the loader is dropped)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if isinstance(pool, _PROCESS_POOL):
            pool.terminate()
            pool.join()
        else:
            pool.shutdown(wait=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def stats(self):
        """wait_s, last_wait_s, batches, samples, bytes, skipped, queue_depth, consumer_reads, elapsed_s; token loaders also
        count tokens, padding, truncated and padding_fraction (pad tokens / all tokens delivered)."""
        return self._impl.stats()

    def __repr__(self):
        return f"<pacer.data.Loader: {len(self)} batches per epoch over {len(self.dataset)} items>"


class Blend:
    """A weighted mixture of datasets of one kind, read by pacer.data.Loader as one stream (pacer.data.blend makes one).

    Position n of the blend draws from the dataset the quota schedule names: after n draws (from the start, or
    from the last change of weights) dataset i has given floor(w_i*n) or ceil(w_i*n) items. Each dataset is read in
    its own seeded order per epoch of it, and one that runs out starts its next epoch. An epoch of the blend is
    samples_per_epoch positions (default: the datasets' items together).
    """

    def __init__(self, parts, seed=0, samples_per_epoch=None):
        """parts: [(dataset, weight), ...]; use pacer.data.blend."""
        parts = [(d if isinstance(d, (Dataset, TokenDataset)) else open(d), float(w)) for d, w in parts]
        if not parts:
            raise ValueError("a blend needs at least one (dataset, weight)")
        kinds = {isinstance(d, TokenDataset) for d, _ in parts}
        if len(kinds) > 1:
            raise ValueError("a blend holds tar-shard datasets or token datasets, not both")
        self.tokens = kinds == {True}
        names = [_name(d) for d, _ in parts]
        # The C++ schedule checks the weights, naming the dataset (pacer.Error).
        self.weights = _pacer._blend_weights([w for _, w in parts], names)
        for (d, _), name in zip(parts, names):
            if (d.documents if self.tokens else len(d)) == 0:
                raise Error(f"blend dataset {name} is empty")
        self.parts = parts
        self.seed = int(seed)
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)

    @property
    def datasets(self):
        """The datasets, in order."""
        return [d for d, _ in self.parts]

    def __len__(self):
        """Positions per epoch of the blend."""
        if self.samples_per_epoch:
            return self.samples_per_epoch
        return sum(d.documents if self.tokens else len(d) for d in self.datasets)

    def __repr__(self):
        inner = ", ".join(f"({_name(d)}, {w:g})" for d, w in self.parts)
        return f"pacer.data.blend([{inner}], seed={self.seed})"


def _name(ds):
    return ds._impl.prefix if isinstance(ds, TokenDataset) else ds._impl.name


def blend(parts, seed=0, samples_per_epoch=None):
    """A weighted blend: pacer.data.blend([(ds_a, 0.7), (ds_b, 0.3)], seed=0), for pacer.data.Loader.

    Datasets are all tar-shard datasets or all token datasets (or what pacer.data.open takes). Weights are
    normalized; a negative, NaN or infinite weight, weights that do not sum to a positive number, or an empty
    dataset raise pacer.Error naming the dataset. The loader's state_dict() records how many items each dataset
    has given; loading it into a loader over the same blend with other weights continues each dataset where it
    stopped, with the new weights from there on (docs/data.md "Blends").
    """
    return Blend(parts, seed=seed, samples_per_epoch=samples_per_epoch)


def _segments(out, where):
    """(tokens, mask) from a template's result: (prompt_ids, response_ids) or [(ids, trained), ...]."""
    if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], bool):
        out = [(out[0], False), (out[1], True)]
    tokens, mask = [], []
    try:
        for ids, trained in out:
            if not isinstance(trained, bool):
                raise TypeError(f"a segment's trained flag is {type(trained).__name__}, not bool")
            ids = [int(t) for t in ids]
            tokens += ids
            mask += [1 if trained else 0] * len(ids)
    except (TypeError, ValueError) as e:
        raise Error(f"{where}: the template must return (prompt_ids, response_ids) or a list of (ids, trained) "
                    f"segments ({e})") from None
    return tokens, mask


def write_sft(prefix, samples, dtype="int32"):
    """Writes SFT samples: PREFIX.bin/.idx (tokens) and PREFIX.mask.bin/.idx (uint8 loss mask, 1 = trained).

    Each sample is (prompt_ids, response_ids), or a list of (ids, trained) segments for multi-turn data.
    pacer.data.open(PREFIX) then finds the mask, and loader batches carry "labels" and "loss_mask".
    """
    docs, masks = [], []
    for k, sample in enumerate(samples):
        tokens, mask = _segments(sample, f"sample {k}")
        docs.append(tokens)
        masks.append(mask)
    _pacer._write_sft_dataset(os.fsdecode(prefix), dtype, docs, masks)
    return len(docs)


def _chat_lines(path):
    with builtins.open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise Error(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise Error(f"{where}: not JSON ({e})") from None
            messages = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(messages, list):
                raise Error(f'{where}: not a JSON object with a "messages" list')
            for i, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise Error(f'{where}: message {i} is not an object with string "role" and "content"')
            yield where, messages


def write_chat(prefix, paths, template, dtype="int32"):
    """Chat JSON lines ({"messages": [{"role": ..., "content": ...}, ...]} per line) to an SFT dataset.

    template(messages) returns (prompt_ids, response_ids) or a list of (ids, trained) segments; it holds the
    tokenizer and the chat format. A line that is not JSON, not UTF-8 or not a messages list raises pacer.Error
    naming the file and line. Returns the number of samples written (write_sft gives the layout).
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    samples = []
    for path in paths:
        for where, messages in _chat_lines(os.fsdecode(path)):
            samples.append(_segments(template(messages), where))
    docs = [t for t, _ in samples]
    masks = [m for _, m in samples]
    _pacer._write_sft_dataset(os.fsdecode(prefix), dtype, docs, masks)
    return len(docs)


# ---------------------------------------------------------------------------
# Tokenizing: text and JSON lines to a Megatron-Core token dataset.

class _BatchEncoder:
    """Encodes a chunk of documents in a worker process; the ids go back as two byte strings, which pickle as
    one copy each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, docs):
        ids, lengths = array.array("q"), array.array("Q")
        for d in docs:
            e = self.tokenizer(d)
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
    with ctx.Pool(threads, initializer=_stages._init_worker, initargs=(_BatchEncoder(tokenizer),)) as pool:
        opts["encode_batch"] = lambda docs: pool.apply(_stages._run_in_worker, (docs,))
        return json.loads(_pacer._tokenize(*args, opts))

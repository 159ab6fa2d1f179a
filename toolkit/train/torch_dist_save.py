"""megatron-core `dist_checkpointing.save`, with the files written by threads of this process.

megatron-core 0.16.1's torch_dist strategy writes through `FileSystemWriterAsync`: each save forks
one writer process per file, and they report back through a queue that the first save creates as a
`multiprocessing.get_context("spawn").Manager()` (strategies/filesystem_async.py:51-56), a server
process that imports torch to unpickle the results: 5-8 s on the first checkpoint of a run, then
about 0.05 s of forking per save, against about 0.2 s for the whole rest of our checkpoint
(benchmarks/save_bench.py). Here the save is planned by megatron-core as usual (async_sharded_save),
its write buckets are written by the same `write_preloaded_data` megatron-core runs in each forked
process, in threads (file writes release the GIL), and its finalisation (the .metadata index, then
metadata.json) runs as megatron-core's own `execute_sync` would run it.

Every train/ save of a run has the same structure (the same parameters, shardings and ranks), so the
strategy keeps megatron-core's cached save plans and global metadata from one save to the next
(`cached_metadata`, what Megatron-LM's --ckpt-assume-constant-structure turns on: megatron-core
still checks on every save that the local plans did not change), and the sharding is validated on
the first save only.
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist

# No fsync, as for the rest of the checkpoint (DeepSpeed's torch.save, model/): a checkpoint becomes
# `latest` only once every rank has written it (a crashed process cannot leave it half-written), and
# forcing 1x the state to disk on every save made train/ the slowest part of it (benchmarks/save_bench.py).
USE_FSYNC = False
_strategy = None  # this process's TorchDistSaveShardedStrategy, made by the first save


def save(sharded_state_dict: dict, directory: str) -> None:
    """Collective, like dist_checkpointing.save."""
    global _strategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from toolkit.runtime import megatron_versions

    if filesystem_async._results_queue is None:  # read by prepare_write_data; never a Manager's
        filesystem_async._results_queue = queue.Queue()
    first = _strategy is None
    if first:
        _strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    request = dist_checkpointing.save(sharded_state_dict, directory, sharded_strategy=_strategy,
                                      validate_access_integrity=first, async_sharded_save=True,
                                      **megatron_versions.save_kwargs())
    if request.async_fn is not None:  # None where this rank has nothing to write
        _write_buckets(request)
    dist.barrier()  # as AsyncRequest.execute_sync: every rank's files are written
    for finalize in request.finalize_fns:
        finalize()


def _write_buckets(request) -> None:
    """What write_preloaded_data_multiproc does with forked processes, with threads, after staging
    the tensors to the CPU as AsyncRequest.execute_sync does: the writer takes CPU tensors only
    (filesystem_async.py:392 `assert tensor.is_cpu`), and on a GPU DeepSpeed's states are not."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    transforms, _use_msc = request.async_fn.args
    _rank, buckets, results_queue = request.async_fn_args
    if request.preload_fn is not None:
        buckets = request.preload_fn()
    local, count = queue.Queue(), queue.Queue()
    threads = []
    for index, bucket in enumerate(buckets):
        count.put(index)  # each writer takes one off when done (its protocol)
        threads.append(threading.Thread(target=FileSystemWriterAsync.write_preloaded_data,
                                        args=(transforms, index, bucket, local, count, USE_FSYNC)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = dict(local.get() for _ in buckets)
    failed = next((r for r in results.values() if isinstance(r, Exception)), None)
    results_queue.put(failed if failed is not None else results)

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
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist


def save(sharded_state_dict: dict, directory: str) -> None:
    """Collective, like dist_checkpointing.save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:  # read by prepare_write_data; never a Manager's
        filesystem_async._results_queue = queue.Queue()
    request = dist_checkpointing.save(sharded_state_dict, directory, async_sharded_save=True)
    if request.async_fn is not None:  # None where this rank has nothing to write
        _write_buckets(request)
    dist.barrier()  # as AsyncRequest.execute_sync: every rank's files are written
    for finalize in request.finalize_fns:
        finalize()


def _write_buckets(request) -> None:
    """What write_preloaded_data_multiproc does with forked processes, with threads."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    transforms, _use_msc = request.async_fn.args
    _rank, buckets, results_queue = request.async_fn_args
    local, count = queue.Queue(), queue.Queue()
    threads = []
    for index, bucket in enumerate(buckets):
        count.put(index)  # each writer takes one off when done (its protocol)
        threads.append(threading.Thread(target=FileSystemWriterAsync.write_preloaded_data,
                                        args=(transforms, index, bucket, local, count, True)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = dict(local.get() for _ in buckets)
    failed = next((r for r in results.values() if isinstance(r, Exception)), None)
    results_queue.put(failed if failed is not None else results)

"""What the ranks' agreement costs a step under cuda_graphs: one ``CaptureSchedule.decide`` per graphed training call,
that is, hashing the call's signature and one MAX all-reduce of three int64 (the digest, its negation and a refusal
flag) on the host (gloo) group.

    python benchmarks/capture_agreement.py --ranks 2 --calls 2000
    python benchmarks/capture_agreement.py --ranks 8

Each rank is a process on this host with a gloo group over TCP on localhost, as TitanStrategy's ``host_control``
group is on one node (across nodes a round trip adds the network's latency). Every rank decides for the same
signature (the 1B step's token batch, 2 x 8192), so after the warm-up every call is a replay decision, as in
training. Rank 0 prints the median and the 99th percentile per call, and the hash alone for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_strategy.parallelize.cuda_graph import CaptureSchedule, _digest, _signature


def rank_main(rank: int, ranks: int, calls: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks, timeout=timedelta(seconds=60))
    signature = _signature((torch.zeros(2, 8192, dtype=torch.long),))
    schedule = CaptureSchedule(warmup_steps=2, group=dist.group.WORLD)
    for _ in range(3):  # the warm-up calls and the capture decision
        schedule.decide(signature)
    schedule.settle_capture(signature, True)
    decide, digest = [], []
    for _ in range(calls):
        start = time.perf_counter()
        assert schedule.decide(signature) == "replay"
        decide.append(time.perf_counter() - start)
        start = time.perf_counter()
        _digest(signature)
        digest.append(time.perf_counter() - start)
    if rank == 0:
        def micros(times: list[float]) -> str:
            ordered = sorted(times)
            return (f"median {statistics.median(ordered) * 1e6:.1f} us, "
                    f"p99 {ordered[int(0.99 * (len(ordered) - 1))] * 1e6:.1f} us")
        print(f"{ranks} ranks, {calls} calls, {os.cpu_count()} CPUs: decide (hash + gloo all-reduce) "
              f"{micros(decide)}; hash alone {micros(digest)}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: the agreement only runs with more than one rank; pass 2 or more")
    mp.start_processes(rank_main, args=(args.ranks, args.calls, args.port), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()

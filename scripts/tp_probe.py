"""Checks the collectives tensor parallelism needs, on two GPUs, in well under a minute.

    python scripts/tp_probe.py

Two spawned ranks, each on its GPU, go through what the engine's ranks do, in its order: join an
NCCL group over TCP on 127.0.0.1, make the gloo group the step broadcasts use, broadcast an
object over it, and all-reduce a tensor over NCCL. Each rank prints each stage as it passes,
and dumps its stack and exits if it is stuck for 40 s, so a hang names its stage.
"""

from __future__ import annotations

import faulthandler
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STUCK_SECONDS = 40


def rank_main(rank: int, port: int) -> None:
    faulthandler.dump_traceback_later(STUCK_SECONDS, exit=True)
    print(f"rank {rank}: started", flush=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    print(f"rank {rank}: NCCL group joined", flush=True)
    control = dist.new_group(backend="gloo")
    print(f"rank {rank}: gloo group made", flush=True)
    box = [{"step": 1}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0, group=control)
    print(f"rank {rank}: gloo broadcast got {box[0]}", flush=True)
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {rank}: NCCL all-reduce gave {t.tolist()} (expected 3.0 each)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs two GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2)
    print("tensor-parallel collectives: ok")


if __name__ == "__main__":
    main()

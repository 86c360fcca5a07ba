"""Workers find each other through a torch.distributed TCPStore.

Rank 0 hosts the store; every worker publishes where its peers can reach it
(its address per peer: on the emulator each pair has its own link and so its
own address; on real hosts one address, keyed ``*``) and its data-plane port,
then reads everyone else's. The emulator passes each worker the store's
address on its link to rank 0; on real machines the same worker is started
with the store host (``MASTER_ADDR``-style) and its own address, nothing else.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta


def rendezvous(rank: int, world: int, store_host: str, store_port: int, port: int,
               my_addrs: dict[str, str], secret: bytes = b"", timeout_s: float = 120.0):
    """Return ({peer: (address to reach it, port)}, store, run secret). Keep the store
    alive: rank 0's worker serves it, and it waits until every rank has read the table.

    The run secret that authenticates peers (``transport``) is rank 0's (drawn here if
    it was given none); a worker given one keeps its own. The store itself is not
    authenticated, so on a shared network the secret is as private as its port."""
    from torch.distributed import TCPStore

    store = TCPStore(store_host, store_port, world, is_master=(rank == 0),
                     timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    if rank == 0:
        secret = secret or os.urandom(32)
        store.set("htr/secret", secret.hex())
    elif not secret:
        secret = bytes.fromhex(store.get("htr/secret").decode())
    store.set(f"htr/worker/{rank}", json.dumps({"port": port, "addrs": my_addrs}))
    peers = {}
    for p in range(world):
        if p == rank:
            continue
        info = json.loads(store.get(f"htr/worker/{p}"))  # blocks until p has published
        addr = info["addrs"].get(str(rank), info["addrs"].get("*"))
        if addr is None:
            raise RuntimeError(f"worker {p} published no address for worker {rank}: {info}")
        peers[p] = (addr, int(info["port"]))
    store.set(f"htr/read/{rank}", "1")
    if rank == 0:  # the store lives in this process: serve it until everyone has read
        store.wait([f"htr/read/{p}" for p in range(world)], timedelta(seconds=timeout_s))
    return peers, store, secret

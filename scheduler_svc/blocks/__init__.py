"""The block manager's concerns, one module each; scheduler_svc/block_manager.py composes
them behind the API the scheduler calls.

* allocator.py — one tier's free list.
* table.py — a request's block table, and `RequestBlocks`, the frozen view callers get.
* plan.py — the iteration's transfer plan being built and the blocks its copies touch.
* pool.py — both tiers: reference counts, parked cached blocks, fences, batches in flight.
* prefix.py — the prefix index: block names, lookup, attaching a cached prefix.
* swap.py — rotation: swap-out/in, their costs, eager copies.
* recovery.py — forgetting what a peer lost (DESIGN §6).
* integrity.py — `check_integrity`, the invariants the tests check after every step.

Pure Python, no torch.
"""

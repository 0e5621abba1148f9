"""The update on several workers: a resident group of Ray actors with DDP or FSDP2.

``group`` is the driver side (called by ``phases/update.py`` in the process that runs the
update unit): it forms, reuses and dismisses the group; ``worker`` is the actor every rank
runs, keeping the trained policy between units; ``sharding`` builds the replicated or sharded
model and writes its full weights; ``handover`` passes the new weights to the engines through
Ray's object store. See ADR 0008.
"""

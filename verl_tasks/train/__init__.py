"""The update on several workers: Ray Train (``TorchTrainer``) with DDP or FSDP2.

``launch`` is the driver side (called by ``phases/update.py`` in the process that runs
the update unit); ``worker`` is the loop every Ray Train worker runs; ``sharding``
builds the replicated or sharded model and writes its full weights. See ADR 0006.
"""

"""Operations after a fault: verify/inspect/export snapshots, rollback, gc, safe mode, snapshot fallback.

Each module is a small set of functions over a store; the CLI commands
``checkpoint``, ``rollback``, ``gc`` and ``resume`` are thin shells on them.
"""

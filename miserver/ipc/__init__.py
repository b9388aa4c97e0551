"""Attachable loads and handle export (weights page: Which models can be attached; Rebuilding
the tensors in the trainer; Releasing the handles; contract section 8).

- :mod:`miserver.ipc.arena`: ``make_attachable(model, *, cpu_shared, device=None)`` places every
  parameter of a device in one dedicated allocation (a private ``torch.cuda.MemPool``, or CPU
  shared memory) and returns the :class:`~miserver.ipc.arena.ParameterArena`.
- :mod:`miserver.ipc.attachability`: ``not_attachable_reason(...)``, the NOT_ATTACHABLE reason in
  the table's order (pure), and ``should_make_attachable(...)`` for the loader.
- :mod:`miserver.ipc.export`: ``export_handles(arena, model)`` (storages, parameters, producer,
  release, config), ``exports_since_start()``, ``cuda_memory()``, ``moved_parameters(arena,
  model)``, ``reclaim()``.
- :mod:`miserver.ipc.devices`: device UUIDs and the producer build.

The trainer side is :mod:`miserver.trainer`.
"""

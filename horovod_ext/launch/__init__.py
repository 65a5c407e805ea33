"""The launchers: hvdrun (console script ``hvdrun`` -> ``horovod_ext.launch.run:main``),
``horovod_ext.run()``, the elastic driver and the Ray executor.

Modules: ``options`` (flags, checks, HOROVOD_* variables), ``hosts`` (host lists, rank layout),
``netinfo`` (addresses, free port; also run on remote hosts), ``remote`` (ssh commands, host
checks), ``agent`` (runs one rank, takes signals over stdin), ``supervise`` (output, start-up
timeout, failures, signals), ``mpi`` (mpirun for Open MPI and MPICH), ``run`` (entry point),
``elastic`` (the elastic driver), ``api``/``driver``/``task`` (``horovod_ext.run``), ``ray``
(``RayExecutor``, public as ``horovod_ext.ray``).

Layer 5, the top: it may import every layer below, but its modules load without torch, so
hvdrun starts fast and runs where torch is missing.  The runtime is imported only inside the
functions that need it: ``--check-build`` (``horovod_ext.torch``), ``--plan``
(``horovod_ext.planning``), a worker's task and the elastic driver's store
(``torch.distributed``).  tests/test_layers.py checks that loading them imports no torch.
"""

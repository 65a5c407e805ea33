"""hvdrun, the horovodrun-compatible launcher (console script ``hvdrun`` -> ``launch.run:main``).

Modules: ``options`` (flags, checks, HOROVOD_* variables), ``hosts`` (host lists, rank layout),
``netinfo`` (addresses, free port; also run on remote hosts), ``remote`` (ssh commands, host
checks), ``agent`` (runs one rank, takes signals over stdin), ``supervise`` (output, start-up
timeout, failures, signals), ``mpi`` (mpirun for Open MPI and MPICH), ``run`` (entry point).
Layer 4: it uses horovod_ext only through ``horovod_ext.torch`` (for --check-build) and the
package version, and never imports torch otherwise.
"""

"""Horovod's environment variables, read once at init and checked, with clear errors.

Horovod's names and defaults where Horovod has the variable; our additions are named in the same
style and listed in docs/environment.md.
"""
import os
from dataclasses import dataclass
from typing import Mapping, Optional


# The elastic driver's count of host changes, in its store: a worker compares it with its
# generation's.  Here, in a module without torch, because the launcher (which never imports
# torch) and the workers' bootstrap share it.
ELASTIC_UPDATES_KEY = "horovod_ext/elastic/hosts_updates"


class ConfigError(ValueError):
    """An environment variable holds a value horovod_ext cannot use."""


def _get(env, name, default, parse, check=None, expect=""):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
    except ValueError:
        value = None
    if value is None or (check is not None and not check(value)):
        raise ConfigError(f"{name}={raw!r} is not valid: expected {expect}")
    return value


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on", "y", "t"):
        return True
    if low in ("0", "false", "no", "off", "n", "f"):
        return False
    raise ValueError(raw)


def _choice(*options):
    def parse(raw):
        low = raw.lower()
        if low not in options:
            raise ValueError(raw)
        return low
    return parse


def fused_kernels(env: Mapping[str, str] = os.environ) -> str:
    """HOROVOD_FUSED_KERNELS: which tensors the torch.compile'd kernels serve: "cuda" (the
    default), "all" (CPU tensors too, which is how the tests check them without a GPU) or
    "off" (the plain torch code everywhere)."""
    return _get(env, "HOROVOD_FUSED_KERNELS", "cuda", _choice("cuda", "all", "off"),
                expect="'cuda', 'all' or 'off'")


@dataclass
class Config:
    fusion_threshold: int = 128 * 1024 * 1024   # bytes; 0 disables fusion
    fusion_max_tensor_bytes: int = 1024 * 1024  # larger requests are reduced on their own
    gradient_bucket_bytes: int = 25 * 1024 * 1024  # DistributedOptimizer buckets; 0: none
    first_bucket_bytes: int = 1024 * 1024        # backward's first gradients' bucket; 0: as others
    gradient_bucket_plan: str = "auto"           # "auto" | "timed" (measured cut) | "size"
    bucket_lane: bool = True                     # buckets in order on a lane (reduction/lane.py)
    keep_host_heap: bool = True                  # glibc keeps freed memory (engine/host_heap.py)
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    hierarchical_allreduce: bool = False
    hierarchical_allreduce_auto: bool = True     # unset: DistributedOptimizer measures both ways
    hierarchical_allgather: bool = False
    cpu_operations: Optional[str] = None         # "mpi" | "gloo" | None (auto)
    gpu_operations: Optional[str] = None         # "nccl" | "mpi" | None (auto)
    stall_check: bool = True
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0                # 0: never abort stalled tensors
    deadlock_s: float = 10.0                     # every rank blocked, nothing matches; 0: off
    heartbeat_s: float = 2.0                     # liveness beats; 2 missed: stopped; 0: off
    timeout_s: float = 60.0
    control_iface: Optional[str] = None
    log_level: str = "warning"
    dynamic_process_sets: bool = False           # hvd.add_process_set after init allowed
    shared_memory: bool = True                   # in-node steps through shared memory
    hierarchical_chunk_bytes: int = 0            # pipelined hierarchical chunks; 0: automatic
    timeline: Optional[str] = None               # file; "DYNAMIC": hvd.start_timeline only
    timeline_mark_cycles: bool = False
    timeline_all_ranks: bool = False             # one file per rank, not rank 0's alone
    fused_kernels: str = "cuda"                  # "cuda" | "all" | "off"; read here so that a bad
                                                 # value fails hvd.init (algorithms.compiled
                                                 # reads the variable itself: no init needed)
    autotune: bool = False
    autotune_log: Optional[str] = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8

    @classmethod  # long: one entry per variable, read in one place
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Config":
        positive = lambda v: v > 0  # noqa: E731
        non_negative = lambda v: v >= 0  # noqa: E731
        timeout = _get(env, "HOROVOD_GLOO_TIMEOUT_SECONDS", 60.0, float, positive,
                       "a positive number of seconds")
        return cls(
            fusion_threshold=_get(env, "HOROVOD_FUSION_THRESHOLD", cls.fusion_threshold, int,
                                  non_negative, "a non-negative number of bytes"),
            fusion_max_tensor_bytes=_get(env, "HOROVOD_FUSION_MAX_TENSOR_BYTES",
                                         cls.fusion_max_tensor_bytes, int, non_negative,
                                         "a non-negative number of bytes"),
            gradient_bucket_bytes=_get(env, "HOROVOD_GRADIENT_BUCKET_BYTES",
                                       cls.gradient_bucket_bytes, int, non_negative,
                                       "a non-negative number of bytes"),
            first_bucket_bytes=_get(env, "HOROVOD_FIRST_BUCKET_BYTES", cls.first_bucket_bytes,
                                    int, non_negative, "a non-negative number of bytes"),
            gradient_bucket_plan=_get(env, "HOROVOD_GRADIENT_BUCKET_PLAN", "auto",
                                      _choice("auto", "timed", "size"),
                                      expect="'auto', 'timed' or 'size'"),
            bucket_lane=_get(env, "HOROVOD_BUCKET_LANE", cls.bucket_lane, _bool, expect="0 or 1"),
            keep_host_heap=_get(env, "HOROVOD_KEEP_HOST_HEAP", cls.keep_host_heap, _bool,
                                expect="0 or 1"),
            cycle_time_ms=_get(env, "HOROVOD_CYCLE_TIME", cls.cycle_time_ms, float, non_negative,
                               "a non-negative number of milliseconds"),
            cache_capacity=_get(env, "HOROVOD_CACHE_CAPACITY", cls.cache_capacity, int,
                                non_negative, "a non-negative integer"),
            hierarchical_allreduce_auto=not (env.get("HOROVOD_HIERARCHICAL_ALLREDUCE")
                                             or "").strip(),
            hierarchical_allreduce=_get(env, "HOROVOD_HIERARCHICAL_ALLREDUCE", False, _bool,
                                        expect="0 or 1"),
            hierarchical_allgather=_get(env, "HOROVOD_HIERARCHICAL_ALLGATHER", False, _bool,
                                        expect="0 or 1"),
            cpu_operations=_get(env, "HOROVOD_CPU_OPERATIONS", None, _choice("mpi", "gloo"),
                                expect="'mpi' or 'gloo'"),
            gpu_operations=_get(env, "HOROVOD_GPU_OPERATIONS", None, _choice("nccl", "mpi"),
                                expect="'nccl' or 'mpi'"),
            stall_check=not _get(env, "HOROVOD_STALL_CHECK_DISABLE", False, _bool,
                                 expect="0 or 1"),
            stall_warning_s=_get(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0, float, positive,
                                 "a positive number of seconds"),
            stall_shutdown_s=_get(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0, float,
                                  non_negative, "a non-negative number of seconds"),
            deadlock_s=_get(env, "HOROVOD_DEADLOCK_TIME_SECONDS", 10.0, float, non_negative,
                            "a non-negative number of seconds"),
            heartbeat_s=_get(env, "HOROVOD_HEARTBEAT_SECONDS", 2.0, float, non_negative,
                             "a non-negative number of seconds"),
            timeout_s=_get(env, "HOROVOD_COMM_TIMEOUT_SECONDS", timeout, float, positive,
                           "a positive number of seconds"),
            control_iface=_get(env, "HOROVOD_GLOO_IFACE", None, str),
            log_level=_get(env, "HOROVOD_LOG_LEVEL", "warning",
                           _choice("trace", "debug", "info", "warning", "error", "fatal"),
                           expect="one of trace, debug, info, warning, error, fatal"),
            dynamic_process_sets=_get(env, "HOROVOD_DYNAMIC_PROCESS_SETS", False, _bool,
                                      expect="0 or 1"),
            shared_memory=_get(env, "HOROVOD_SHARED_MEMORY", True, _bool, expect="0 or 1"),
            hierarchical_chunk_bytes=_get(env, "HOROVOD_HIERARCHICAL_CHUNK_BYTES", 0, int,
                                          non_negative, "a non-negative number of bytes"),
            timeline=_get(env, "HOROVOD_TIMELINE", None, str),
            timeline_mark_cycles=_get(env, "HOROVOD_TIMELINE_MARK_CYCLES", False, _bool,
                                      expect="0 or 1"),
            timeline_all_ranks=_get(env, "HOROVOD_TIMELINE_ALL_RANKS", False, _bool,
                                    expect="0 or 1"),
            fused_kernels=fused_kernels(env),
            autotune=_get(env, "HOROVOD_AUTOTUNE", False, _bool, expect="0 or 1"),
            autotune_log=_get(env, "HOROVOD_AUTOTUNE_LOG", None, str),
            autotune_warmup_samples=_get(env, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, int,
                                         non_negative, "a non-negative integer"),
            autotune_steps_per_sample=_get(env, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 10, int,
                                           positive, "a positive integer"),
            autotune_bayes_opt_max_samples=_get(env, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
                                                20, int, positive, "a positive integer"),
            autotune_gaussian_process_noise=_get(env, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                                 0.8, float, positive, "a positive number"),
        )

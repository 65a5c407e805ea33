"""hvdrun's command line: horovodrun's flags, checked, and the HOROVOD_* variables they set.

A bad value stops hvdrun with a message naming the flag and exit status 2 (argparse's
convention), before anything starts.
"""
import argparse
import os
import shlex

from . import hosts as hostlib

DEFAULT_START_TIMEOUT_S = 30.0
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


def _number(kind, parse, ok, expect):
    def convert(raw):
        try:
            value = parse(raw)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expect}, got {raw!r}")
        return value
    convert.__name__ = kind
    return convert


positive_int = _number("positive_int", int, lambda v: v > 0, "a positive integer")
non_negative_int = _number("non_negative_int", int, lambda v: v >= 0, "a non-negative integer")
port_number = _number("port", int, lambda v: 0 < v < 65536, "a port number (1-65535)")
positive_float = _number("positive_float", float, lambda v: v > 0, "a positive number")
non_negative_float = _number("non_negative_float", float, lambda v: v >= 0,
                             "a non-negative number")


def _log_level(raw):
    if raw.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), "
                                         f"got {raw!r}")
    return raw.lower()


def _default_start_timeout():
    raw = os.environ.get("HOROVOD_START_TIMEOUT")
    if not raw:
        return DEFAULT_START_TIMEOUT_S
    try:
        return positive_float(raw)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"hvdrun: error: HOROVOD_START_TIMEOUT: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdrun",
        description="Start a horovod_ext job: np processes over the given hosts, with Gloo "
                    "(default; local processes and ssh) or MPI (mpirun). Compatible with "
                    "horovodrun's flags.",
        usage="hvdrun [-h] [-np N] [-H HOSTS | --hostfile FILE] [--gloo | --mpi] [options] "
              "COMMAND [ARGS...]")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print which frameworks, controllers, tensor operations and reduction "
                        "ops are available, and exit")
    p.add_argument("-np", "--num-proc", dest="np", type=positive_int,
                   help="number of processes (default: all slots of -H/--hostfile)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="HOST:SLOTS,... (default localhost:NP)")
    where.add_argument("-hostfile", "--hostfile", help="file with one 'HOST slots=N' per line")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", action="store_true",
                      help="start ranks directly (ssh for other hosts); the default")
    mode.add_argument("--mpi", action="store_true", help="start ranks with mpirun")
    p.add_argument("--mpi-args", default="", help="extra arguments for mpirun (one string)")
    p.add_argument("--network-interfaces", "--network-interface", dest="network_interfaces",
                   help="comma-separated interfaces (e.g. eth0) for the rendezvous and data")
    p.add_argument("-p", "--ssh-port", type=port_number, help="ssh port on every host")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key")
    p.add_argument("--ssh-command", default=None,
                   help="remote shell used instead of ssh (called as CMD HOST COMMAND); e.g. "
                        "the network lab's nsrsh")
    p.add_argument("--start-timeout", type=positive_float, default=None,
                   help="seconds for the hosts to answer, and for every rank to reach and "
                        "finish hvd.init() once the first has (default: $HOROVOD_START_TIMEOUT "
                        f"or {DEFAULT_START_TIMEOUT_S:.0f})")
    p.add_argument("--output-filename",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--verbose", action="store_true", help="print what hvdrun runs")
    _add_runtime_flags(p)
    _add_elastic_flags(p)
    _add_plan_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    tune = p.add_argument_group("runtime settings (HOROVOD_* variables for every rank)")
    tune.add_argument("--fusion-threshold-mb", type=non_negative_float,
                      help="fusion buffer size in MiB (0 disables fusion)")
    tune.add_argument("--cycle-time-ms", type=non_negative_float,
                      help="milliseconds between negotiation cycles")
    tune.add_argument("--cache-capacity", type=non_negative_int,
                      help="response cache entries")
    tune.add_argument("--disable-cache", action="store_true", help="no response cache")
    hier = tune.add_mutually_exclusive_group()
    hier.add_argument("--hierarchical-allreduce", dest="hierarchical_allreduce",
                      action="store_const", const=True, default=None)
    hier.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce",
                      action="store_const", const=False)
    hier_ag = tune.add_mutually_exclusive_group()
    hier_ag.add_argument("--hierarchical-allgather", dest="hierarchical_allgather",
                         action="store_const", const=True, default=None)
    hier_ag.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                         action="store_const", const=False)
    tune.add_argument("--timeline-filename",
                      help="write a timeline (Chrome trace) of the collectives to this file "
                           "(HOROVOD_TIMELINE)")
    tune.add_argument("--timeline-mark-cycles", action="store_true",
                      help="mark each engine cycle on the timeline (HOROVOD_TIMELINE_MARK_CYCLES)")
    tune.add_argument("--timeline-all-ranks", action="store_true",
                      help="every rank writes its own timeline, <stem>.rank<N>.json "
                           "(HOROVOD_TIMELINE_ALL_RANKS)")
    tune.add_argument("--autotune", action="store_true",
                      help="tune fusion, cycle time, buckets, cache and hierarchy while training "
                           "(HOROVOD_AUTOTUNE; needs scikit-learn)")
    tune.add_argument("--autotune-log-file", help="CSV of every sample (HOROVOD_AUTOTUNE_LOG)")
    tune.add_argument("--autotune-warmup-samples", type=non_negative_int,
                      help="samples left out of the search (default 3)")
    tune.add_argument("--autotune-steps-per-sample", type=positive_int,
                      help="training steps per sample (default 10)")
    tune.add_argument("--autotune-bayes-opt-max-samples", type=positive_int,
                      help="samples before settling on the best (default 20)")
    tune.add_argument("--autotune-gaussian-process-noise", type=positive_float,
                      help="score noise the Gaussian process assumes (default 0.8)")
    tune.add_argument("--no-stall-check", action="store_true", help="no stall warnings")
    tune.add_argument("--stall-check-warning-time-seconds", type=positive_float)
    tune.add_argument("--stall-check-shutdown-time-seconds", type=non_negative_float)
    tune.add_argument("--log-level", type=_log_level, help=", ".join(LOG_LEVELS))


def _add_elastic_flags(p: argparse.ArgumentParser) -> None:
    el = p.add_argument_group("elastic mode (workers may leave and join; Gloo only)")
    el.add_argument("--min-np", type=positive_int,
                    help="fewest workers to train with (default: -np)")
    el.add_argument("--max-np", type=positive_int,
                    help="most workers to run at once (default: -np)")
    el.add_argument("--host-discovery-script",
                    help="command printing the hosts on offer, one HOST:SLOTS per line; run "
                         "every second")
    el.add_argument("--slots-per-host", type=positive_int,
                    help="slots of a host the discovery script prints without :SLOTS")
    el.add_argument("--elastic-timeout", type=positive_float, default=600.0,
                    help="seconds to wait for --min-np workers after a failure (default 600)")
    el.add_argument("--reset-limit", type=non_negative_int,
                    help="most re-formings of the job before it fails")
    el.add_argument("--blacklist-cooldown-range", type=non_negative_float, nargs=2,
                    metavar=("MIN", "MAX"),
                    help="a failed host may come back after a random time in [MIN, MAX] s "
                         "(default: never)")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    pl = p.add_argument_group(
        "scale model", "hvdrun --plan prints each op's predicted step time on a cluster (no job "
                       "starts; needs SimGrid: apt-get install python3-simgrid)")
    pl.add_argument("--plan", action="store_true",
                    help="predict step times for the cluster and model below, and exit")
    pl.add_argument("--model-size", help="trainable parameters, e.g. 340M or 1.3B")
    pl.add_argument("--compute-ms", type=non_negative_float, default=0.0,
                    help="forward + backward time per step on one rank, ms (default 0)")
    pl.add_argument("--optimizer-ms", type=non_negative_float, default=None,
                    help="the optimizer step's time on one rank, ms (default: this machine's "
                         "per-core cost for the model's size, from the profile)")
    pl.add_argument("--nodes", type=positive_int, default=2, help="nodes (default 2)")
    pl.add_argument("--ranks-per-node", type=positive_int, default=1,
                    help="ranks on each node (default 1)")
    pl.add_argument("--link", default="10gbit", help="each node's link rate (default 10gbit)")
    pl.add_argument("--latency", default="25us",
                    help="one-way latency between nodes (default 25us)")
    pl.add_argument("--nodes-per-rack", type=non_negative_int, default=0,
                    help="nodes behind one top-of-rack switch (default 0: one switch)")
    pl.add_argument("--oversubscription", type=positive_float, default=1.0,
                    help="rack uplink oversubscription, e.g. 3 for 3:1 (default 1)")
    pl.add_argument("--plan-ops", help="ops to compare, comma-separated (default: all)")
    pl.add_argument("--plan-profile", help="calibrated costs (default: the package's "
                                           "horovod_ext/planning/profile_cpu.json)")


def parse(argv=None) -> argparse.Namespace:
    """Checked options, with ``hosts`` (list of (name, slots)) and ``slots`` (one per rank)
    added; exits 2 with a message for bad values."""
    parser = build_parser()
    o = parser.parse_args(argv)
    if o.version or o.check_build:
        return o
    if o.plan:
        if o.command:
            parser.error("--plan starts no job: drop the command")
        if not o.model_size:
            parser.error("--plan needs --model-size (e.g. 340M)")
        return o
    if not o.command:
        parser.error("no command given: e.g. hvdrun -np 2 python train.py")
    if o.start_timeout is None:
        o.start_timeout = _default_start_timeout()
    if o.stall_check_warning_time_seconds is not None and o.no_stall_check:
        parser.error("--no-stall-check and --stall-check-warning-time-seconds contradict")
    try:
        o.mpi_args = shlex.split(o.mpi_args)
    except ValueError as exc:
        parser.error(f"--mpi-args: {exc}")
    try:
        o.ssh = shlex.split(o.ssh_command) if o.ssh_command else ["ssh"]
    except ValueError as exc:
        parser.error(f"--ssh-command: {exc}")
    if not o.ssh:
        parser.error("--ssh-command is empty")
    o.interfaces = [i for i in (o.network_interfaces or "").split(",") if i.strip()]
    if o.network_interfaces is not None and not o.interfaces:
        parser.error("--network-interfaces names no interface")
    o.elastic = bool(o.host_discovery_script or o.min_np or o.max_np)
    if o.elastic and _check_elastic(parser, o):
        return o
    _place_ranks(parser, o)
    return o


def _check_elastic(parser: argparse.ArgumentParser, o: argparse.Namespace) -> bool:
    """Check elastic mode's flags and fill its defaults; True when a discovery script will
    supply the hosts (nothing to place now)."""
    if o.mpi:
        parser.error("elastic mode (--min-np, --max-np, --host-discovery-script) runs over "
                     "Gloo, not mpirun: drop --mpi")
    if o.np is None:
        o.np = o.min_np
    if o.np is None:
        parser.error("elastic mode needs -np or --min-np")
    o.min_np = o.min_np or o.np
    if o.max_np is not None and o.max_np < o.min_np:
        parser.error(f"--max-np {o.max_np} is less than --min-np {o.min_np}")
    if o.blacklist_cooldown_range and \
            o.blacklist_cooldown_range[0] > o.blacklist_cooldown_range[1]:
        parser.error("--blacklist-cooldown-range: MIN is larger than MAX")
    if o.host_discovery_script:
        if o.hosts or o.hostfile:
            parser.error("--host-discovery-script and -H/--hostfile contradict")
        o.host_list, o.slots = [], []
        return True
    return False


def _place_ranks(parser: argparse.ArgumentParser, o: argparse.Namespace) -> None:
    """``host_list`` from -H, --hostfile or localhost, and one slot per rank."""
    try:
        if o.hosts:
            o.host_list = hostlib.parse_hosts(o.hosts)
        elif o.hostfile:
            o.host_list = hostlib.read_hostfile(o.hostfile)
        else:
            if o.np is None:
                parser.error("-np is required without -H/--hosts or --hostfile")
            o.host_list = [("localhost", o.np)]
        if o.np is None:
            o.np = sum(s for _, s in o.host_list)
        o.slots = [] if o.elastic else hostlib.assign(o.host_list, o.np)
    except hostlib.HostError as exc:
        parser.error(str(exc))


def horovod_env(o: argparse.Namespace) -> dict:
    """The HOROVOD_* (and interface) variables the flags ask for, for every rank."""
    env = {"HOROVOD_START_TIMEOUT": f"{o.start_timeout:g}"}
    if o.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(o.fusion_threshold_mb * 1024 * 1024))
    if o.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{o.cycle_time_ms:g}"
    if o.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(o.cache_capacity)
    if o.disable_cache:
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    if o.hierarchical_allreduce is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if o.hierarchical_allreduce else "0"
    if o.hierarchical_allgather is not None:
        env["HOROVOD_HIERARCHICAL_ALLGATHER"] = "1" if o.hierarchical_allgather else "0"
    if o.timeline_filename:
        env["HOROVOD_TIMELINE"] = o.timeline_filename
    if o.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if o.timeline_all_ranks:
        env["HOROVOD_TIMELINE_ALL_RANKS"] = "1"
    if o.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    for flag, name in (("autotune_log_file", "LOG"), ("autotune_warmup_samples", "WARMUP_SAMPLES"),
                       ("autotune_steps_per_sample", "STEPS_PER_SAMPLE"),
                       ("autotune_bayes_opt_max_samples", "BAYES_OPT_MAX_SAMPLES"),
                       ("autotune_gaussian_process_noise", "GAUSSIAN_PROCESS_NOISE")):
        value = getattr(o, flag)
        if value is not None:
            env[f"HOROVOD_AUTOTUNE_{name}"] = f"{value:g}" if isinstance(value, float) \
                else str(value)
    if o.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if o.stall_check_warning_time_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = f"{o.stall_check_warning_time_seconds:g}"
    if o.stall_check_shutdown_time_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = f"{o.stall_check_shutdown_time_seconds:g}"
    if o.log_level:
        env["HOROVOD_LOG_LEVEL"] = o.log_level
    if o.interfaces:
        # The runtime's control plane and torch's Gloo take one interface, NCCL a list.
        env.update(HOROVOD_GLOO_IFACE=o.interfaces[0], GLOO_SOCKET_IFNAME=o.interfaces[0],
                   NCCL_SOCKET_IFNAME=",".join(o.interfaces))
    return env

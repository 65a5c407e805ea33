#!/usr/bin/env python3
"""Round-trip latency for the network lab, where the kernel has no netem.

``netlab_delay.py --delay-ms D --queue Q NS...`` holds every packet that arrives on a lab host
(an iptables NFQUEUE rule on each namespace's eth0, in PREROUTING, that tools/netlab.sh adds)
for D milliseconds and then lets it through: two hosts then see a round trip of 2*D on top of
the shaped rate, as a wide-area link adds its propagation delay.  Standard library only: it
speaks nfnetlink_queue itself.

How: one netlink socket per namespace, bound to queue Q with metadata-only copies and whole
GSO packets (so a 64 KiB TCP segment is one message, not 44).  Packets of one queue arrive with
increasing ids and all wait the same time, so releasing them is one batch verdict "accept every
id up to N" per wake-up, not one message per packet.  SIGTERM or SIGINT releases what waits and
exits.  The rules use --queue-bypass and the queue is bound fail-open, so packets pass
undelayed, not dropped, when no daemon listens or its queue is full.
"""
import argparse
import collections
import ctypes
import os
import select
import signal
import socket
import struct
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CLONE_NEWNET = 0x40000000
_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("=BBH")
_NLATTR = struct.Struct("=HH")


def _attr(kind, payload):
    data = _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(msg_type, queue, attrs, flags=NLM_F_REQUEST, seq=0):
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + b"".join(attrs)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type,
                          flags, seq, 0) + body


def _in_namespace(name, make):
    """``make()`` run inside network namespace ``name``; a socket keeps the namespace it was
    made in."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name}")
        try:
            return make()
        finally:
            libc.setns(home, CLONE_NEWNET)
    finally:
        os.close(home)
        os.close(target)


def _expect_ack(sock, what):
    reply = sock.recv(65536)
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        if error != 0:
            raise OSError(-error, f"nfnetlink_queue refused {what}: {os.strerror(-error)}")


def open_queue(namespace, queue, maxlen=1 << 16):
    """A netlink socket in ``namespace`` bound to NFQUEUE ``queue`` (metadata only, GSO whole,
    fail-open)."""
    def make():
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)   # SO_RCVBUFFORCE: root may exceed rmem_max
        sock.bind((0, 0))
        return sock
    sock = _in_namespace(namespace, make)
    flags = NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN
    for what, attrs in [
            ("binding the queue", [_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0))]),
            ("metadata-only copies", [_attr(NFQA_CFG_PARAMS, struct.pack("!IBxxx", 0, NFQNL_COPY_META)),
                                      _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))]),
            ("GSO and fail-open", [_attr(NFQA_CFG_FLAGS, struct.pack("!I", flags)),
                                   _attr(NFQA_CFG_MASK, struct.pack("!I", flags))])]:
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        _expect_ack(sock, what)
    return sock


def packet_ids(data):
    """The packet ids of every queued-packet message in one netlink read."""
    ids, offset = [], 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + _NLMSGHDR.size + _NFGENMSG.size
            while at + _NLATTR.size <= offset + length:
                alen, atype = _NLATTR.unpack_from(data, at)
                if alen < _NLATTR.size:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + _NLATTR.size)[0])
                    break
                at += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return ids


def release_up_to(sock, queue, packet_id):
    sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue,
                       [_attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))]))


def serve(namespaces, queue, delay_s, ready=lambda: None):
    """Hold each namespace's queued packets ``delay_s`` and release them, until signalled;
    ``ready()`` once every queue is bound."""
    sockets = {open_queue(ns, queue): collections.deque() for ns in namespaces}
    ready()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    while not stop:
        now = time.monotonic()
        due = [waiting[0][0] for waiting in sockets.values() if waiting]
        timeout = max(0.0, min(due) + delay_s - now) if due else 0.5
        try:
            ready, _, _ = select.select(list(sockets), [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for sock in ready:
            try:
                data = sock.recv(1 << 20)
            except OSError:   # ENOBUFS: the kernel dropped messages; fail-open keeps packets
                continue
            sockets[sock].extend((now, pid) for pid in packet_ids(data))
        for sock, waiting in sockets.items():
            last = None
            while waiting and waiting[0][0] + delay_s <= now:
                last = waiting.popleft()[1]
            if last is not None:
                release_up_to(sock, queue, last)
    for sock, waiting in sockets.items():
        if waiting:
            release_up_to(sock, queue, waiting[-1][1])
        sock.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True,
                        help="one-way delay added to every packet a host receives")
    parser.add_argument("--queue", type=int, default=7, help="NFQUEUE number the rules use")
    parser.add_argument("--ready-file", help="written once every queue is bound")
    parser.add_argument("namespaces", nargs="+")
    args = parser.parse_args()
    if args.delay_ms <= 0:
        parser.error("--delay-ms must be positive")
    def ready():
        if args.ready_file:
            with open(args.ready_file, "w") as f:
                f.write(str(os.getpid()))
    serve(args.namespaces, args.queue, args.delay_ms / 1000, ready)


if __name__ == "__main__":
    main()

"""The network lab's added round trip (tools/netlab.sh delay, tools/netlab_delay.py).

The message parsing is checked on bytes built here; the delay itself on a real two-host lab
(root, iproute2 and iptables-legacy), by timing TCP round trips between the namespaces with and
without it (benchmarks/lab_links.py's measurement).
"""
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from tests.harness import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))
import netlab_delay  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import lab_links  # noqa: E402  (it takes benchmarks/ off sys.path again)

LAB = os.path.join(REPO, "tools", "netlab.sh")
# A prefix and subnet of their own, so a lab a user has up is left alone.
LAB_ENV = dict(os.environ, NL_PREFIX="tnl", NL_SUBNET="10.203.0")


def _queued_packet(packet_id, with_other_attr=True):
    """A netlink NFQNL_MSG_PACKET message as the kernel sends it (header attribute not first)."""
    attrs = b""
    if with_other_attr:
        attrs += netlab_delay._attr(9, b"\x00\x00\x05\xdc")      # NFQA_PAYLOAD-like filler
    attrs += netlab_delay._attr(netlab_delay.NFQA_PACKET_HDR,
                                struct.pack("!IHB", packet_id, 0x0800, 0))
    body = netlab_delay._NFGENMSG.pack(socket.AF_INET, 0, socket.htons(7)) + attrs
    kind = (netlab_delay.NFNL_SUBSYS_QUEUE << 8) | netlab_delay.NFQNL_MSG_PACKET
    return netlab_delay._NLMSGHDR.pack(16 + len(body), kind, 0, 0, 0) + body


@pytest.mark.timeout(10)
def test_packet_ids_of_a_netlink_read():
    data = _queued_packet(41) + _queued_packet(42, False) + _queued_packet(1 << 31)
    assert netlab_delay.packet_ids(data) == [41, 42, 1 << 31]
    # other messages (an ack) and a cut-off tail are skipped, not misread
    ack = netlab_delay._NLMSGHDR.pack(20, netlab_delay.NLMSG_ERROR, 0, 0, 0) + b"\0" * 4
    assert netlab_delay.packet_ids(ack + _queued_packet(7) + _queued_packet(8)[:20]) == [7]


def _lab_missing():
    if os.geteuid() != 0:
        return "the network lab needs root"
    for tool in ("ip", "iptables-legacy"):
        if shutil.which(tool) is None:
            return f"the network lab's delay needs {tool} (apt-get install iproute2 iptables)"
    return None


def _lab(*args):
    subprocess.run([LAB, *args], env=LAB_ENV, check=True, timeout=60,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


# What a kernel or container without namespaces, iptables' NFQUEUE target or nfnetlink_queue
# answers; anything else the lab prints is a failure of the lab.
MISSING_FROM_KERNEL = ("Operation not permitted", "can't initialize iptables",
                       "No chain/target/match", "nfnetlink_queue refused", "Protocol not supported",
                       "Address family not supported")


def _lab_or_skip(*args):
    try:
        _lab(*args)
    except subprocess.CalledProcessError as failure:
        said = failure.stdout.decode(errors="replace")
        if any(m in said for m in MISSING_FROM_KERNEL):
            pytest.skip(reason=f"this kernel or container cannot run the lab's {args[0]}: "
                               f"{said[-300:]}")
        raise


def _median_rtt_ms():
    """lab_links' measurement (TCP round trips, then 1 MiB of bulk) between this test's hosts."""
    return lab_links.measure(1, hosts=("tnl-0", "tnl-1"), address="10.203.0.2")["rtt_ms"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(_lab_missing() is not None, reason=str(_lab_missing()))
def test_delay_adds_the_round_trip_and_zero_removes_it():
    _lab("down")
    try:
        _lab_or_skip("up", "2", "1gbit")
        with pytest.raises(subprocess.CalledProcessError) as bad:
            _lab("delay", "fast")
        assert "bad round-trip time fast" in bad.value.stdout.decode()
        before = _median_rtt_ms()
        _lab_or_skip("delay", "30ms")
        delayed = _median_rtt_ms()
        _lab("delay", "0")
        after = _median_rtt_ms()
    finally:
        _lab("down")
    assert before < 5, before
    assert 30 <= delayed < 45, delayed
    assert after < 5, after
    # the daemon is gone with the lab, and no rule is left to hold packets
    assert not os.path.exists("/run/netlab-tnl-delay.pid")
